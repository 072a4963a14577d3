import sys

from launch.launcher.cli import main

sys.exit(main())

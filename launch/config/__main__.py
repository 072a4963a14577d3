"""`python -m launch.config [--check]`: rewrite configs/base.yaml from the schema, or only compare."""

import sys

from launch.config.schema import main

sys.exit(main(sys.argv[1:]))

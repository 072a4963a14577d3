"""The floor every part stands on: file names and atomic writes (`files`), the environment variables
shared between processes (`envvars`), logging set-up (`log`). Imports nothing else of scaleout."""

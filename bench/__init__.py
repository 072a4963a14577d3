"""Benchmarks of scaleout against plain reference loops: `python -m bench [--quick] [--json]`."""

"""The JAX trainer: `python -m jaxrun --config CELL/config.yaml`."""

# Quickstart: `make demo` (the JAX-vs-PyTorch scaling comparison on this machine) and `make test`.
# Each target builds its own virtualenv in .venv from the pinned CPU set in constraints.txt.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test]'
	touch $@

# The tests also compile for TPU slices (`plan --compile target=tpu`): the tpu-aot extra brings libtpu (~680 MB).
$(VENV)/.installed-tpu-aot: $(VENV)/.installed
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test,tpu-aot]'
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/scaleout sweep sweep=cpu run.name=demo

test: $(VENV)/.installed-tpu-aot
	$(BIN)/python -m pytest $(PYTEST_ARGS)

.PHONY: install demo test

# Quickstart: `make demo` (the JAX-vs-PyTorch scaling comparison on this machine) and `make test`.
# Each target builds its own virtualenv in .venv from the pinned CPU set in constraints.txt.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=
# Holistic Trace Analysis, xprof's converter and torch-tb-profiler, which tests/test_profile_tools.py opens traces
# with: without their declared dependencies (HTA's jupyterlab; xprof's GCS client and web server), whose runtime
# ones the test extra has
TRACE_READERS := holistictraceanalysis xprof torch-tb-profiler

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test]'
	$(BIN)/python -m pip install -q -c constraints.txt --no-deps $(TRACE_READERS)
	touch $@

# The tests also compile for TPU slices (`plan --compile target=tpu`): the tpu-aot extra brings libtpu (~680 MB).
$(VENV)/.installed-tpu-aot: $(VENV)/.installed
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test,tpu-aot]'
	touch $@

# `plan --compile` for NVIDIA GPUs (the gpu-aot extra, ~575 MB, ~40 s to install) goes into a venv of its own layered
# on .venv: a jax CUDA plugin makes every JAX start without JAX_PLATFORMS=cpu print its failed CUDA probe, which the
# main test run must not see. Its tests (-m gpu_aot) run there; in the main run they skip, saying where they run.
GPU_AOT_VENV ?= .venv-gpu-aot
$(GPU_AOT_VENV)/.installed: $(VENV)/.installed-tpu-aot
	$(PYTHON) -m venv $(GPU_AOT_VENV)
	$(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > "$$($(GPU_AOT_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/scaleout-base.pth"
	$(GPU_AOT_VENV)/bin/python -m pip install -q -c constraints.txt -e '.[gpu-aot]'
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/scaleout sweep sweep=cpu run.name=demo
	@echo "scaleout is installed in $(VENV), not on your PATH: 'source $(VENV)/bin/activate' before the README's other commands"

test: $(VENV)/.installed-tpu-aot $(GPU_AOT_VENV)/.installed
	$(BIN)/python -m pytest $(PYTEST_ARGS)
	SCALEOUT_GPU_AOT_TESTS=1 $(GPU_AOT_VENV)/bin/python -m pytest -m gpu_aot tests/test_aot.py

.PHONY: install demo test

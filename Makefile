# Quickstart: `make demo` (the JAX-vs-PyTorch scaling comparison on this machine) and `make test`.
# Each target builds its own virtualenv in .venv from the pinned CPU set in constraints.txt.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=
# pytest-xdist workers for `make test` (the SLURM tests are one unit, on one worker: tests/conftest.py); 0: one process
PYTEST_WORKERS ?= 2
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

# llama.cpp's converter (convert_hf_to_gguf.py, its conversion/ package and gguf-py), which tests/test_gguf.py runs on
# an export: taken from the pinned llama-cpp-python sdist on PyPI (77 MB download, 2 MB kept), Python only, nothing built
LLAMA_CPP_PYTHON ?= 0.3.36
LLAMA_CPP ?= .cache/llama.cpp-$(LLAMA_CPP_PYTHON)
$(LLAMA_CPP)/convert_hf_to_gguf.py: | $(VENV)/.installed
	rm -rf $(LLAMA_CPP).tmp && mkdir -p $(LLAMA_CPP).tmp
	$(BIN)/python -m pip download -q --no-deps --no-binary :all: llama-cpp-python==$(LLAMA_CPP_PYTHON) -d $(LLAMA_CPP).tmp
	tar xzf $(LLAMA_CPP).tmp/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C $(LLAMA_CPP).tmp --strip-components=3 \
	    --wildcards '*/vendor/llama.cpp/convert_hf_to_gguf.py' '*/vendor/llama.cpp/conversion/*' '*/vendor/llama.cpp/gguf-py/*'
	rm $(LLAMA_CPP).tmp/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz
	rm -rf $(LLAMA_CPP) && mv $(LLAMA_CPP).tmp $(LLAMA_CPP)

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/scaleout sweep sweep=cpu run.name=demo
	@echo "scaleout is installed in $(VENV), not on your PATH: 'source $(VENV)/bin/activate' before the README's other commands"

test: $(VENV)/.installed-tpu-aot $(GPU_AOT_VENV)/.installed $(LLAMA_CPP)/convert_hf_to_gguf.py
	SCALEOUT_LLAMA_CPP=$(abspath $(LLAMA_CPP)) $(BIN)/python -m pytest -n $(PYTEST_WORKERS) --durations=30 $(PYTEST_ARGS)
	SCALEOUT_GPU_AOT_TESTS=1 $(GPU_AOT_VENV)/bin/python -m pytest -m gpu_aot tests/test_aot.py

.PHONY: install demo test

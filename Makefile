# Two commands on a fresh machine: `make demo` and `make test`.
# Both create .venv on first use. torch is pinned here (setup path only) so a
# CPU machine installs the local CPU wheel instead of a multi-GB CUDA build;
# the package itself requires a range, so GPU users keep their CUDA build.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test test-fast clean gpu-check gpu-bundle

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(PY) -m onepass.demo --out runs/demo

# One worker per core, whole files per worker (module fixtures are built once).
PYTEST_PAR ?= -n auto --dist loadfile

test: setup
	$(PY) -m pytest -q $(PYTEST_PAR)

test-fast: setup   # everything but the two whole-benchmark runs (marked slow)
	$(PY) -m pytest -q $(PYTEST_PAR) -m "not slow"

# The GPU machine has no network: `make gpu-bundle` here downloads the wheels it needs (for its
# Python, GPU_BUNDLE_PYTHON) into $(GPU_BUNDLE)/part-N/, each part under 64 MiB. `make gpu-check`
# there uses that machine's own python and CUDA torch (no venv, no torch install), installs the
# bundle with pip --no-index, runs its steps (each under 10 minutes; CUDA steps skip in one line
# without CUDA) and writes gpu-check-results.tar.gz. See README "Running on a GPU".
GPU_PYTHON ?= python3
GPU_BUNDLE ?= gpu-bundle
GPU_BUNDLE_PYTHON ?= 3.12

gpu-bundle: setup
	$(PY) -m onepass.bench.gpu_bundle --out $(GPU_BUNDLE) --python-version $(GPU_BUNDLE_PYTHON)

gpu-check:
	PYTHONPATH=$(CURDIR)/src $(GPU_PYTHON) -m onepass.bench.gpu_check --bundle $(GPU_BUNDLE) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis

# Two commands on a fresh machine: `make demo` and `make test`.
# Both create .venv on first use, from constraints.txt (versions known to pass).
# torch is pinned here (setup path only) so a CPU machine installs the local
# CPU wheel instead of a multi-GB CUDA build; the package itself requires
# ranges, so users are not pinned and GPU users keep their CUDA build.
# `make test-latest` runs the suite on the newest release of every dependency
# (run it before new work; fix breaks in src/onepass/model/couplings.py, never by a
# pin), `make test-min` on the oldest the metadata allows (constraints-min.txt).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

LOCK ?= constraints.txt
.PHONY: setup demo test test-fast test-quick test-latest test-min test-compat test-skyrl lock clean gpu-check gpu-bundle gpu-sim

# --no-compile, then compileall on every core: the same bytecode pip writes one file at a time (28 s of a 61 s
# install on 2 cores, 15 s this way); a file that does not compile (torch ships a Python 3.12-only one) is
# skipped, as pip skips it.
$(VENV)/.installed: pyproject.toml Makefile $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile "$(TORCH_PIN)"
	$(PY) -m pip install --quiet --no-compile -c $(LOCK) -e ".[test]"
	$(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null || true
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(PY) -m onepass.demo --out runs/demo

# One worker per core, whole files per worker (module fixtures are built once).
PYTEST_PAR ?= -n auto --dist loadfile

test: setup
	$(PY) -m pytest -q $(PYTEST_PAR)

test-fast: setup   # everything but the slow tests
	$(PY) -m pytest -q $(PYTEST_PAR) -m "not slow"

# The inner loop (under 3 minutes on 2 cores): no slow, multi-process or end-to-end test. The tests
# of one stage: pytest tests/<stage> (tests/ mirrors src/onepass/).
test-quick: setup
	$(PY) -m pytest -q $(PYTEST_PAR) -m "not slow and not multiprocess and not e2e"

# A pip cap a machine may set for every venv (a global constraint file, e.g. torch<=2.14.1) is lifted for the
# test-min/test-latest venvs only, by pointing PIP_CONSTRAINT at an empty file (an empty PIP_CONSTRAINT= does
# not lift it); no system file is touched. The PyPI torch is a CUDA build (it runs on CPU): a multi-GB
# download the first time, from pip's cache after.
NO_CAP = PIP_CONSTRAINT=$(CURDIR)/$(1)/no-constraints.txt $(1)/bin/python -m pip

# The next releases, before they ship: the newest torch (TORCH_LATEST), the newest release of every
# dependency, then pre-releases (pip --pre) of the libraries onepass couples to (LATEST_PRE; empty: none),
# then source folders where given (TRANSFORMERS_SRC=path PEFT_SRC= ACCELERATE_SRC= TRL_SRC=: a checkout, a
# wheel or any pip requirement). Prints the private names the installed releases lack, then runs SUITES
# (default: the whole suite). CI does not run it. Example:
#   TRANSFORMERS_SRC=~/src/transformers make test-latest SUITES="tests/model/test_couplings.py tests/mixers"
TORCH_LATEST ?= torch
LATEST_PRE ?= transformers peft accelerate trl
SUITES ?=
test-latest:
	rm -rf .venv-latest && $(PYTHON) -m venv .venv-latest && : > .venv-latest/no-constraints.txt
	$(call NO_CAP,.venv-latest) install --quiet --upgrade pip
	$(call NO_CAP,.venv-latest) install --quiet --upgrade "$(TORCH_LATEST)"
	$(call NO_CAP,.venv-latest) install --quiet --upgrade --upgrade-strategy eager -e ".[test]"
	$(if $(strip $(LATEST_PRE)),$(call NO_CAP,.venv-latest) install --quiet --upgrade --pre $(LATEST_PRE))
	@for src in $(TRANSFORMERS_SRC) $(PEFT_SRC) $(ACCELERATE_SRC) $(TRL_SRC); do \
	  echo "installing $$src"; $(call NO_CAP,.venv-latest) install --quiet "$$src" || exit 1; done
	@.venv-latest/bin/python -m pip list 2>/dev/null | grep -iE "^(torch|transformers|peft|accelerate|datasets|trl|tokenizers) "
	@.venv-latest/bin/python -c "from onepass.model.private_names import missing_private_names as m; \
	  print('private names missing:', ', '.join(m()) or 'none')"
	.venv-latest/bin/python -m pytest -q $(PYTEST_PAR) $(SUITES)

# After `make test-latest` passed on releases (LATEST_PRE= and no *_SRC): record what it ran as the lock
# CI installs. Pre-releases and source installs are refused: they are not what a user gets from pip.
lock:
	@test -x .venv-latest/bin/python || { echo "make lock: run make test-latest first"; exit 1; }
	@! .venv-latest/bin/python -m pip freeze --exclude-editable 2>/dev/null | grep -iE "(a|b|rc|dev)[0-9]*$$| @ " \
	  || { echo "make lock: .venv-latest holds the pre-releases or source installs above; run" \
	       "make test-latest LATEST_PRE= (no *_SRC) first"; exit 1; }
	{ sed -n '/^#/p' $(LOCK); .venv-latest/bin/python -m pip freeze --exclude-editable 2>/dev/null \
	  | grep -viE "^(torch|onepass)[=@ ]"; } > $(LOCK).new && mv $(LOCK).new $(LOCK)

# The oldest releases pyproject.toml allows (constraints-min.txt; torch: TORCH_MIN, the floor), on the
# suites that touch them.
TORCH_MIN ?= torch==2.11.0
MIN_SUITES ?= tests/test_architectures.py tests/mixers tests/model/test_couplings.py tests/guard/test_guard.py \
	tests/test_head.py tests/train tests/test_real_templates.py tests/data tests/bench/test_bench_trl.py
test-min:
	rm -rf .venv-min && $(PYTHON) -m venv .venv-min && : > .venv-min/no-constraints.txt
	$(call NO_CAP,.venv-min) install --quiet --upgrade pip
	$(call NO_CAP,.venv-min) install --quiet "$(TORCH_MIN)"
	$(call NO_CAP,.venv-min) install --quiet -c constraints-min.txt -e ".[test]"
	@.venv-min/bin/python -m pip list 2>/dev/null | grep -iE "^(torch|transformers|peft|accelerate|datasets|trl|numpy) "
	.venv-min/bin/python -m pytest -q $(PYTEST_PAR) $(MIN_SUITES)

# The transformers releases the RL stacks pin (docs/rl.md: ART 5.2.0, prime-rl 5.6.2, SkyRL <=5.8.0, verl
# <5.11, OpenRLHF 5.15.0), each in its own venv (.venv-compat/transformers-X, made once and reused; the
# machine-wide pip cap lifted for these venvs only), everything else from constraints.txt where that
# release allows it; COMPAT_SUITES on each, then one table: per architecture, exact, refused (the one line)
# or absent from that release, per release. A failure anywhere is FAIL in the table and the target fails.
RELEASES ?= 5.2.0 5.6.2 5.8.0 5.10.4 5.15.0
COMPAT_TORCH ?= torch==2.13.0
COMPAT_SUITES ?= tests/test_equivalence.py tests/test_architectures.py tests/mixers tests/model/test_couplings.py \
	tests/rl/test_exactness.py
test-compat: setup
	@mkdir -p .venv-compat/results && : > .venv-compat/no-constraints.txt
	@grep -viE "^(transformers|tokenizers|huggingface[-_]hub)==" $(LOCK) > .venv-compat/lock-but-transformers.txt
	@for r in $(RELEASES); do v=.venv-compat/transformers-$$r; \
	  if [ ! -f $$v/.installed ]; then echo "making $$v"; rm -rf $$v && $(PYTHON) -m venv $$v && \
	    PIP_CONSTRAINT=$(CURDIR)/.venv-compat/no-constraints.txt $$v/bin/python -m pip install --quiet "$(COMPAT_TORCH)" && \
	    PIP_CONSTRAINT=$(CURDIR)/.venv-compat/no-constraints.txt $$v/bin/python -m pip install --quiet \
	      -c .venv-compat/lock-but-transformers.txt -e ".[test]" "transformers==$$r" && touch $$v/.installed \
	    || { echo "test-compat: could not install transformers $$r"; exit 1; }; fi; \
	  echo "== transformers $$r"; \
	  $$v/bin/python -m pytest -q -p no:cacheprovider $(PYTEST_PAR) $(COMPAT_SUITES) \
	    --junitxml=.venv-compat/results/$$r.xml > .venv-compat/results/$$r.log 2>&1; \
	  tail -1 .venv-compat/results/$$r.log; done
	$(PY) tests/compat_table.py $(addprefix .venv-compat/results/,$(addsuffix .xml,$(RELEASES)))

# SkyRL's own code against onepass's tree (docs/rl.md#skyrl): .venv-skyrl (made once, reused) holds
# skyrl==0.3.0 (it pins transformers<=5.8.0 and peft==0.18.1) and the part of its skyrl-train extra that
# CPU can install; flash-attn 2.8.3 is installed without its CUDA kernels (FLASH_ATTENTION_SKIP_CUDA_BUILD),
# for the pure-torch bert_padding SkyRL's model wrapper imports. ray, vLLM and FSDP's CUDA path do not run
# here: `make gpu-check` runs SkyRL's FSDP workers on a GPU.
SKYRL_VENV ?= .venv-skyrl
SKYRL_PIN ?= skyrl==0.3.0
SKYRL_CPU_DEPS ?= skyrl-gym==0.4.0 aiohttp loguru omegaconf hydra-core==1.3.2 jaxtyping einops ray==2.56.0 tensordict torchdata \
	func_timeout
$(SKYRL_VENV)/.installed:
	rm -rf $(SKYRL_VENV) && $(PYTHON) -m venv $(SKYRL_VENV) && : > $(SKYRL_VENV)/no-constraints.txt
	$(call NO_CAP,$(SKYRL_VENV)) install --quiet --upgrade pip
	$(call NO_CAP,$(SKYRL_VENV)) install --quiet "$(COMPAT_TORCH)" "setuptools>=77" wheel psutil ninja packaging
	FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE FLASH_ATTENTION_FORCE_BUILD=TRUE $(call NO_CAP,$(SKYRL_VENV)) install --quiet \
	  --no-build-isolation \
	  --no-deps flash-attn==2.8.3
	$(call NO_CAP,$(SKYRL_VENV)) install --quiet "$(SKYRL_PIN)" $(SKYRL_CPU_DEPS) -e ".[test]"
	touch $@

test-skyrl: $(SKYRL_VENV)/.installed
	@$(SKYRL_VENV)/bin/python -m pip list 2>/dev/null | grep -iE "^(torch|transformers|peft|skyrl|ray|flash.attn) "
	$(SKYRL_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/rl/test_skyrl.py

# The GPU machine (docs/gpu.md): no network, its own Python 3.12 and CUDA torch, 15 minutes of device time
# per session. `make gpu-bundle` here downloads the few wheels its image lacks (<= 40 MiB, one folder,
# git-ignored); `make gpu-check` there, with gpu-bundle carried, is the whole check in one command that
# ends by itself within 7 minutes: the machine's own python and torch (no venv, no torch install), the
# bundle installed with pip --no-index --no-deps --target, CUDA steps skipped in one line without CUDA (and
# then exit 3: nothing was measured), gpu-check.json + gpu-check.log into $OUT (else gpu-check-results/).
# `make gpu-sim` runs it here, offline, as it runs there: a venv with torch 2.11.0 (PyPI's build, on CPU)
# and the image's packages (configs/gpu-image.txt), the bundle for this Python, pip pointed at no index.
GPU_PYTHON ?= python3
GPU_BUNDLE ?= gpu-bundle
GPU_BUNDLE_PYTHON ?= 3.12
GPU_SIM_VENV ?= .venv-gpu-sim
GPU_SIM_PY := $(GPU_SIM_VENV)/bin/python

gpu-bundle:
	$(PYTHON) -m pip --version >/dev/null
	PYTHONPATH=$(CURDIR)/src $(PYTHON) -m onepass.bench.gpu_bundle --out $(GPU_BUNDLE) --python-version $(GPU_BUNDLE_PYTHON)

gpu-check:
	PYTHONUNBUFFERED=1 PYTHONPATH=$(CURDIR)/src $(GPU_PYTHON) -m onepass.bench.gpu_check --bundle $(GPU_BUNDLE) $(GPU_CHECK_ARGS)

# torch 2.11.0 is older than this machine's pip constraint allows: an empty constraint file, this venv only
$(GPU_SIM_VENV)/.installed: configs/gpu-image.txt
	$(PYTHON) -m venv $(GPU_SIM_VENV)
	: > $(GPU_SIM_VENV)/no-constraints.txt
	PIP_CONSTRAINT=$(CURDIR)/$(GPU_SIM_VENV)/no-constraints.txt $(GPU_SIM_PY) -m pip install --quiet torch==2.11.0
	PIP_CONSTRAINT=$(CURDIR)/$(GPU_SIM_VENV)/no-constraints.txt $(GPU_SIM_PY) -m pip install --quiet -r configs/gpu-image.txt
	touch $@

gpu-sim: $(GPU_SIM_VENV)/.installed
	$(MAKE) gpu-bundle GPU_BUNDLE=$(GPU_SIM_VENV)/bundle GPU_BUNDLE_PYTHON=$$($(GPU_SIM_PY) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
	env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 $(MAKE) gpu-check GPU_PYTHON=$(GPU_SIM_PY) \
	  GPU_BUNDLE=$(GPU_SIM_VENV)/bundle GPU_CHECK_ARGS="--rehearsal --out gpu-check-results/sim --site /tmp/onepass-gpu-site-sim \
	  --work /tmp/onepass-gpu-check-sim"

clean:
	rm -rf $(VENV) .venv-latest .venv-min $(GPU_SIM_VENV) runs .pytest_cache .hypothesis

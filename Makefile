# Set-up and entry points. `make demo` and `make test` work on a fresh machine:
# they create .venv, install the pinned CPU torch first (a bare `torch` would pull a
# multi-GB CUDA build), then this package with its test extras.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0

.PHONY: setup demo test test-fast clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e ".[test]"
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

demo: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/gspo demo

test: setup
	HF_HUB_OFFLINE=1 $(PY) -m pytest

test-fast: setup  # the lane for development: everything but @pytest.mark.slow (torchrun, subprocess runs, labs, > ~3 s)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -m "not slow"

clean:
	rm -rf $(VENV) runs .pytest_cache

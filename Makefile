# Set-up and entry points. `make demo` and `make test` work on a fresh machine:
# they create .venv, install the pinned CPU torch first (a bare `torch` would pull a
# multi-GB CUDA build), then this package with its test extras.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0

.PHONY: setup demo test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/gspo demo

test: setup
	HF_HUB_OFFLINE=1 $(PY) -m pytest

clean:
	rm -rf $(VENV) runs .pytest_cache

# `make demo` and `make test` set up a fresh machine themselves: a .venv with the tested torch and this package.
PYTHON ?= python3
VENV := .venv
TORCH := torch==2.13.0
READY := $(VENV)/.ready

.PHONY: demo test lint format install clean

install: $(READY)

$(READY): pyproject.toml Makefile
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet $(TORCH)
	$(VENV)/bin/pip install --quiet -e '.[dev]'
	touch $(READY)

demo: $(READY)
	$(VENV)/bin/torchrun --nproc-per-node 2 examples/train_gpt.py

test: $(READY)
	$(VENV)/bin/python -m pytest -q --durations=25 tests

lint: $(READY)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(READY)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) build *.egg-info

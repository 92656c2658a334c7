# `make demo` and `make test` set up a fresh machine themselves: a venv with a supported torch and this package.
# TORCH picks the torch release: the newest supported one by default (in .venv), another in .venv-$(TORCH)
# (`make test TORCH=2.13.0`).
PYTHON ?= python3
NEWEST_TORCH := 2.15.0
TORCH ?= $(NEWEST_TORCH)
VENV := $(if $(filter $(NEWEST_TORCH),$(TORCH)),.venv,.venv-$(TORCH))
READY := $(VENV)/.ready
# TORCH names the release exactly: a cap on torch in the machine's pip configuration (a constraints file) is lifted
# for these installs, which keep every other setting (indexes, local wheels)
PIP_ENV := PIP_CONSTRAINT=/dev/null
# What CI runs on each older supported torch: the torch boundary, parity with that torch's fully_shard (1-D, HSDP,
# FSDP + TP, the module API, pipeline schedules, torchao float8) and checkpoints.
BOUNDARY_TESTS := tests/test_torch_boundary.py tests/test_training.py tests/test_module_api.py \
	tests/test_tensor_parallel.py tests/test_pipeline.py tests/test_float8.py tests/test_checkpoint.py

.PHONY: demo test test-boundary wheel-check docs figures lint format install clean

install: $(READY)

$(READY): pyproject.toml Makefile
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP_ENV) $(VENV)/bin/pip install --quiet torch==$(TORCH)
	$(PIP_ENV) $(VENV)/bin/pip install --quiet -e '.[dev]'
	$(VENV)/bin/python -c "import torch; assert torch.__version__.startswith('$(TORCH)'), torch.__version__"
	touch $(READY)

demo: $(READY)
	$(VENV)/bin/torchrun --nproc-per-node 2 examples/train_gpt.py

test: $(READY)
	$(VENV)/bin/python -m pytest -q --durations=25 tests

test-boundary: $(READY)
	$(VENV)/bin/python -m pytest -q --durations=10 $(BOUNDARY_TESTS)

# The wheel, installed with plain pip into a fresh venv that already holds torch $(TORCH): that torch stays, and
# the README's example, the `fsdp2` backend's entry point and the CLI work from the installed package.
wheel-check: $(READY)
	rm -rf build/wheel build/wheel-venv
	$(PIP_ENV) $(VENV)/bin/pip wheel --quiet --no-deps -w build/wheel .
	$(PYTHON) -m venv build/wheel-venv
	$(PIP_ENV) build/wheel-venv/bin/pip install --quiet torch==$(TORCH)
	$(PIP_ENV) build/wheel-venv/bin/pip install --quiet build/wheel/*.whl
	bash tests/wheel_check.sh build/wheel-venv $(TORCH)

docs: $(READY)
	$(VENV)/bin/mkdocs build --strict --quiet

# The docs' SVG figures into docs/img (benchmarks/figures.py; root and iproute2 for the shaped link, a few minutes).
figures: $(READY)
	$(VENV)/bin/python benchmarks/figures.py

lint: $(READY)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(READY)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf .venv .venv-* build *.egg-info

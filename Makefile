# The two set-up commands of the README: `make demo` and `make test`. Both create .venv when needed.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/mhf: pyproject.toml requirements/cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	DS_BUILD_OPS=0 $(BIN)/pip install --quiet -r requirements/cpu.txt -e '.[dev,eval]'
	touch $(BIN)/mhf

.PHONY: install demo test lint
install: $(BIN)/mhf

demo: install
	$(BIN)/mhf demo

# Two test processes, each with its own Ray instance and servers; a file's tests stay together (its module
# fixtures are built once). Much of a Ray test's time is waiting on processes starting, not computing.
# Files go out slowest first (tests/conftest.py), not xdist's default of most tests first.
test: install
	$(BIN)/pytest -q -n 2 --dist loadfile --no-loadscope-reorder

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

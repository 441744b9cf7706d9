# The two entry points of a fresh machine (README): `make run` and `make test`.
# Both set up .venv first (pip install of the project, which builds the Cython core).
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

.PHONY: setup run test lint bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py $(wildcard native/*.pyx native/*.h native/*.pxd)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[dev,bench]"
	touch $@

run: setup
	$(BIN)/kvroute up $(ARGS)

lint: setup
	$(BIN)/ruff check .

test: setup lint
	$(BIN)/pytest $(PYTEST_ARGS)

bench: setup
	$(BIN)/python -m bench.decode
	$(BIN)/python -m bench.index

clean:
	rm -rf $(VENV) build *.egg-info native/*.so native/*.cpp

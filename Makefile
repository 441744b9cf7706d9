# The two entry points of a fresh machine (README): `make run` and `make test`.
# Both set up .venv first (pip install of the project, which builds the Cython core).
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

.PHONY: setup run test lint bench clean torch-if-cheap

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py $(wildcard native/*.pyx native/*.h native/*.pxd)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[dev,bench]"
	touch $@

run: setup
	$(BIN)/kvroute up $(ARGS)

# ruff over everything; mypy over the packages named in pyproject.toml ([tool.mypy] files).
lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

# The torch engine's tests need PyTorch; install the CPU build only where its wheel already
# lies on disk (the CI machine's /opt/wheels), else those tests skip.
TORCH_WHEEL := $(wildcard /opt/wheels/torch-2.13.0+cpu-cp311-*.whl)
torch-if-cheap: setup
ifneq ($(TORCH_WHEEL),)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_WHEEL)"
endif

test: setup lint torch-if-cheap
	$(BIN)/pytest $(PYTEST_ARGS)

bench: setup
	$(BIN)/python -m bench.decode
	$(BIN)/python -m bench.index

clean:
	rm -rf $(VENV) build *.egg-info native/*.so native/*.cpp

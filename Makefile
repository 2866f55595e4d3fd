# Every target builds the virtual environment it needs from nothing, so `make demo` and
# `make test` work on a fresh clone. torch is pinned to the CPU build that lies on disk.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0

.PHONY: venv browser web-assets demo test test-fast gpu-check lint bench clean s3-server

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e ".[train,dev]"
	# The s3 extra (boto3) without its dependencies' resolution: botocore declares
	# python-dateutil<3, the kubernetes client >=3; botocore runs on the newer one (the
	# checkpoint tiering tests exercise it), so pip must not downgrade it here.
	$(PY) -m pip install --quiet --no-deps "boto3>=1.34" "botocore>=1.34" "s3transfer>=0.10" "jmespath>=1.0"
	# The Training Operator's API models (PyPI kubeflow-training, PyTorchJob) for the tests of
	# examples/, likewise: it declares kubernetes<36, the actuator needs the client >=37.
	$(PY) -m pip install --quiet --no-deps "kubeflow-training>=1.9"
	touch $(STAMP)

# Headless Chromium for the dashboard's browser tests (tests/web), from the distribution's
# packages, never from Playwright's download. Only where it is missing, apt-get exists and
# we are root; elsewhere those tests skip with the reason (and fail under CI=true).
CHROMIUM ?= /usr/bin/chromium

browser:
	@if [ ! -x "$(CHROMIUM)" ] && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		echo "installing chromium (apt-get) for the dashboard's browser tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	fi

# The dashboard's browser code: npm packages pinned by web/frontend/package-lock.json
# (uPlot; esbuild to bundle), built into web/static/ (served under /ui/, packaged with the
# wheel). Rebuilt only when a source or the lockfile changed.
WEB_SRC := $(wildcard web/frontend/src/*.* web/frontend/src/*/*.*) web/frontend/build.mjs
WEB_STAMP := web/static/app.js

web-assets: $(WEB_STAMP)

$(WEB_STAMP): web/frontend/package-lock.json $(WEB_SRC)
	cd web/frontend && npm ci --no-audit --no-fund --loglevel=error && node build.mjs

demo: $(STAMP) web-assets
	$(VENV)/bin/trainguard demo

# The S3-compatible server that the checkpoint tiering tests start on 127.0.0.1 (moto's
# server, pinned), in a venv of its own: moto[server] pins python-dateutil below what the
# kubernetes client in .venv needs. tests/checkpoint/test_tier.py skips without it (fails
# under CI=true).
S3_VENV := .tools/s3venv
S3_STAMP := $(S3_VENV)/.installed
MOTO_PIN := moto[server]==5.2.5

s3-server: $(S3_STAMP)

$(S3_STAMP):
	$(PYTHON) -m venv $(S3_VENV)
	$(S3_VENV)/bin/python -m pip install --quiet "$(MOTO_PIN)"
	touch $(S3_STAMP)

# Workers: more than the 2 cores, since the suite waits on subprocesses, sockets and timers;
# but each worker first imports every test module (~6-8 s of CPU), so past the point where
# the waits overlap a worker costs more than it saves. Measured here: make test the same
# with 4 and 6 workers (7:58 and 7:56 on 27 Nov 13:33, 8:27 and 8:36 on an earlier host),
# make test-fast faster with 6 than with 4 (2:33 against 2:41; 27 Nov 16:27: 2:24 with 6,
# 2:45 with 4, 2:28 with 8). Since the modules go to the workers longest first (by measured
# wall), the waits overlap better and a fifth worker pays: 28 Nov 00:09, back to back,
# 7:10 with 4, 6:44 with 5, 6:33 with 6 (each ~612 s of CPU; 6 workers' load timed out one
# request, so 5). Every figure: README, "Development".
PYTEST_WORKERS ?= 5
PYTEST_FAST_WORKERS ?= 6
# Bytecode caching on even where the environment turns it off (PYTHONDONTWRITEBYTECODE=1,
# common in containers): the suite starts a few hundred interpreters (controllers, agents,
# CLI runs, ranks) and each pytest worker rewrites every test module's asserts; uncached,
# each of them compiles the same sources again. The caches go to the ignored __pycache__/.
PYTEST := PYTHONDONTWRITEBYTECODE= $(PY) -m pytest

# --rerun-show-tracebacks: a slow test that failed once and passed on its rerun still shows
# why it failed in the summary (every rerun is a race to chase, README "Development").
test: $(STAMP) browser web-assets s3-server
	$(PYTEST) -q -n $(PYTEST_WORKERS) --dist loadgroup --durations=15 --rerun-show-tracebacks

test-fast: $(STAMP) web-assets
	$(PYTEST) -q -n $(PYTEST_FAST_WORKERS) --dist loadgroup -m "not slow" --rerun-show-tracebacks

# The CUDA paths (collectives' event timing, on-device NaN/Inf check, probes; the checkpoint
# copier): run wherever a GPU is at hand. Every test in tests/gpu skips without CUDA.
gpu-check: $(STAMP)
	$(PY) -m pytest -m gpu tests/gpu -v

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy trainguard controller agents power collectives checkpoint web demojob
	$(VENV)/bin/lint-imports

BENCHES := ingest detect collectives power traffic traffic_api checkpoint recovery dashboard

# Every bench with --quick (CI's setting), its JSON, plots and REPORT.md in bench/results/;
# BENCH_ARGS=--full for the full runs.
bench: $(STAMP) browser web-assets
	$(PY) -m bench.report --only $(BENCHES) $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

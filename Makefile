# `make demo`, `make test` and `make lint` (docs/reference.md#setup). Each creates .venv when missing and reuses it after.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.warmstart-stamp
TORCHREC := torchrec==1.9.2
# Triton's own cache manager, which the tests compare warmstart's with. Installed beside the venv's
# packages, not among them: the CPU torch must not find a Triton.
TRITON_REFERENCE := triton==3.6.0

# The newest torch release warmstart is checked against (a CUDA build, which brings its Triton), in a
# venv of its own: `make test-newest` runs the tests of the version, precondition and fault paths, the
# compile-cache round trips across new machines and the hooks' own tests under it, on this machine's
# CPU. Compiled frames are off on it (torch_support.FRAMES_VERSIONS_CHECKED): their tests stay out.
NEWEST_VENV := .venv-newest
NEWEST_PY := $(NEWEST_VENV)/bin/python
NEWEST_STAMP := $(NEWEST_VENV)/.warmstart-stamp
NEWEST_TORCH := torch==2.15.0
# The stack's pure-Python packages as pinned for the CPU venv; not the TorchRec ones (fbgemm-gpu-cpu
# 1.9.0, the newest, fails to load its library with this torch: TorchRec cannot run here).
NEWEST_SKIP := ^(torch|fbgemm-gpu-cpu|tensordict|torchmetrics|tqdm|pyre-extensions|typing-inspect|iopath)==
NEWEST_TESTS := tests/compile_cache/test_torch_versions.py tests/compile_cache/test_torch_integration.py \
	tests/compile_cache/test_torch_hooks.py

.PHONY: demo test test-newest lint format setup system-deps clean-venv

setup: $(STAMP) system-deps

$(STAMP): requirements-cpu.txt pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-cpu.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps $(TORCHREC)
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --upgrade --target $(VENV)/triton-reference $(TRITON_REFERENCE)
	touch $(STAMP)

# redis-server (and chromium, for the HTML report test, prometheus, for the live-metrics tests, and
# iproute2's ip, for the network-namespace harness) from Debian when running as root.
system-deps:
	@missing=""; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	command -v prometheus >/dev/null || missing="$$missing prometheus"; \
	command -v ip >/dev/null || missing="$$missing iproute2"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing$$missing"; \
	    (apt-get install -y -q $$missing >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q $$missing >/dev/null)); \
	  else echo "missing:$$missing (install them, e.g. apt-get install$$missing)"; fi; \
	fi
	@command -v redis-server >/dev/null || { echo "redis-server is required"; exit 1; }

demo: setup
	$(VENV)/bin/warmstart bench cold-vs-warm --json warmstart-demo.json --html warmstart-demo.html

# Two workers by default (the suite's reference machine has 2 cores): most tests wait on processes,
# servers and timeouts, so the compiles of one overlap the waits of the other. A test file runs in one
# worker, so its module fixtures (a compiled model, a bench run) are built once.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15

# A machine's pip configuration may cap torch at the releases it keeps on disk: the newest comes from
# the index, with no configuration file read.
$(NEWEST_STAMP): requirements-cpu.txt pyproject.toml Makefile
	test -x $(NEWEST_PY) || $(PYTHON) -m venv $(NEWEST_VENV)
	grep -vE '$(NEWEST_SKIP)' requirements-cpu.txt > $(NEWEST_VENV)/requirements.txt
	PIP_CONFIG_FILE=/dev/null $(NEWEST_PY) -m pip install -q --disable-pip-version-check $(NEWEST_TORCH) \
		-r $(NEWEST_VENV)/requirements.txt
	$(NEWEST_PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $(NEWEST_STAMP)

test-newest: $(NEWEST_STAMP) system-deps
	$(NEWEST_PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(NEWEST_TESTS)

# ruff (pycodestyle, pyflakes, bugbear, isort, pyupgrade, simplify, a complexity limit of 20; the formatter)
# and mypy, configured in pyproject.toml; no import cycle among warmstart's modules; WARMSTART_* read only
# in warmstart/config.py.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) tools/check_imports.py
	$(PY) tools/check_env_reads.py

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean-venv:
	rm -rf $(VENV)

# One-command developer loop. Every target creates .venv itself (idempotently).
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
# torch and torchvision are pinned to a pair whose wheels load together (torchvision's index wheels
# need the default torch build, which imports and runs on the CPU without a GPU). Override with
# TORCH_SPEC='torch torchvision' for the newest pair.
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1

.PHONY: venv deps test test-slow test-incast lint demo proto bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py kspeed/preprocess/_jpegregion.c scripts/system-deps.sh
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	@$(VPY) -m pip install -q --upgrade pip
	@$(VPY) -m pip install -q $(TORCH_SPEC) numpy
	@bash scripts/system-deps.sh $(VENV)
	@$(VPY) -m pip install -q -e '.[dev,gpu]'
	@touch $(STAMP)

deps: venv

test: lint
	@$(VPY) -m pytest -q -m "not slow"

test-slow: venv
	@$(VPY) -m pytest -q -m slow

# Incast and per-server credit across network namespaces (root; skipped with the reason otherwise).
test-incast: venv
	@$(VPY) -m pytest -q -s -m slow tests/integration/test_incast.py

# Format check, lint and type check: what `make test` runs before the tests.
lint: venv
	@$(VPY) -m ruff format --check .
	@$(VPY) -m ruff check .
	@$(VPY) -m mypy

proto: venv
	@$(VPY) scripts/gen_proto.py

demo: venv
	@$(VENV)/bin/kspeed demo

bench: venv
	@$(VPY) bench/rails.py --json bench/results/rails.json
	@$(VPY) bench/first_batch.py --json bench/results/first_batch.json --png bench/results/first_batch.png
	@$(VPY) bench/preprocess.py --json bench/results/preprocess.json --png bench/results/preprocess.png

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

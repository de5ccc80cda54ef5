# The two commands of the README: `make demo` (the main job, `wtcore bench`) and `make test`
# (everything CI runs).
# Both create .venv on first use with plain pip: torch==2.13.0 first (a CPU wheel on this
# machine's disk), then the core and every plugin as editable installs in one pip call, so the
# plugins' `wtcore` requirement resolves to the local core.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PLUGINS := $(wildcard plugins/*/pyproject.toml)
STAMP := $(VENV)/.installed
# vLLM pins its own torch build and friends, so its end-to-end tests start servers from a venv
# of their own (scripts/vllm-venv.sh); the tests themselves run from .venv.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: install demo rl-demo trl-demo test quick lint typecheck pytest pytest-rest dist clean

install: $(STAMP)

$(STAMP): pyproject.toml requirements-dev.txt $(PLUGINS) scripts/system-deps.sh
	scripts/system-deps.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -r requirements-dev.txt -e . $(addprefix -e ,$(dir $(PLUGINS)))
	touch $(STAMP)

$(VLLM_STAMP): scripts/vllm-venv.sh pyproject.toml plugins/channel/pyproject.toml plugins/nccl/pyproject.toml plugins/http_client/pyproject.toml plugins/ipc/pyproject.toml plugins/vllm/pyproject.toml plugins/delta/pyproject.toml plugins/trl/pyproject.toml plugins/mooncake/pyproject.toml plugins/tcp/pyproject.toml
	rm -f $(VLLM_STAMP)
	PYTHON=$(PYTHON) scripts/vllm-venv.sh $(VLLM_VENV)

demo: $(STAMP)
	$(BIN)/wtcore bench --backend tcp --engine-option topology=fanout --client http --receivers 2 --size 256MiB --tensors 300 --rounds 5 --interleave

# The job itself: a small RL loop on CPU, vLLM sampling and wtcore syncing every step, with a
# control run that never syncs (examples/rl_loop). matplotlib (for the PNG) goes into .venv-vllm,
# where the loop runs; nothing else needs it.
RL_OUT ?= rl_loop
rl-demo: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -c 'import matplotlib' 2>/dev/null || $(VLLM_VENV)/bin/python -m pip install --quiet 'matplotlib>=3.6'
	$(VLLM_VENV)/bin/python examples/rl_loop/run.py --json $(RL_OUT).json --plot $(RL_OUT).png

# TRL's GRPOTrainer against a vLLM server, syncing through wtcore-trl (examples/trl_grpo): a
# control run that syncs only step 0, the lines of docs/trl.md, the same with delta=True, and
# a LoRA adapter synced merged into the model (TRL's way) and alone (lora=).
TRL_OUT ?= trl_grpo
trl-demo: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -c 'import matplotlib' 2>/dev/null || $(VLLM_VENV)/bin/python -m pip install --quiet 'matplotlib>=3.6'
	$(VLLM_VENV)/bin/python -W ignore examples/trl_grpo/train.py --steps 10 --runs control,synced,delta,merged,lora --json $(TRL_OUT).json --plot $(TRL_OUT).png

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check wtcore wtcore_kit plugins tests examples benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy

# Any non-zero pytest exit fails, 5 ("no tests collected") included: a collection that finds
# nothing is a broken suite, not a passing one. `make pytest` needs only .venv: without
# .venv-vllm the vLLM tests skip themselves, saying so. Under `make test` (CI) pytest waits for
# .venv-vllm too (make -j included), so the vLLM tests run.
pytest: $(STAMP)
	$(BIN)/python -m pytest

# Everything CI runs, in two pytest sessions that together are `make pytest`: the quick loop
# first (ruff, mypy and the in-process tests, printing its count and time) while .venv-vllm is
# built beside it (one core each), then every test the quick loop leaves out, vLLM's included,
# printing the 30 slowest (where CI's time goes).
test: $(STAMP)
	$(MAKE) --no-print-directory -j2 --output-sync=target quick $(VLLM_STAMP)
	$(MAKE) --no-print-directory pytest-rest

pytest-rest: $(STAMP)
	$(BIN)/python -m pytest -m "not ($(QUICK_MARKERS))" --durations=30

# The loop while you work (under 3 minutes on 2 cores): lint, typecheck, then the tests that
# start no child process, server, torch.distributed group, Ray or vLLM (scripts/quick.sh; each
# test file marks its own `processes` tests).
# PYTEST_ARGS go to pytest: `make quick PYTEST_ARGS='-x -k delta'`.
PYTEST_ARGS ?=
QUICK_MARKERS := not processes and not vllm and not ray and not multinode and not gpu
quick: $(STAMP)
	BIN=$(BIN) STAMP=$(STAMP) MARKERS="$(QUICK_MARKERS)" scripts/quick.sh $(PYTEST_ARGS)

# Every sdist and wheel (the core and each plugin), each built in an isolated environment, then checked as an index
# would check them (CONTRIBUTING.md, "Releasing").
dist: $(STAMP)
	rm -rf dist
	for d in . $(dir $(PLUGINS)); do $(BIN)/python -m build --outdir dist $$d || exit 1; done
	$(BIN)/twine check --strict dist/*

clean:
	rm -rf $(VENV) $(VLLM_VENV) .mypy_cache .ruff_cache build dist *.egg-info plugins/*/build plugins/*/*.egg-info

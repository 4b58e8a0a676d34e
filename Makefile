# Every target creates .venv on a fresh machine and installs what it needs.
# All installs go through constraints.txt, which pins torch to the CPU wheel.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt
STAMP  := $(VENV)/.amanda-installed
export HF_HUB_OFFLINE := 1
export TF_CPP_MIN_LOG_LEVEL := 3
export TRANSFORMERS_VERBOSITY := error

.PHONY: demo test bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip setuptools wheel
	$(PIP) -e ".[torch,tensorflow,onnx,graph,dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/amanda demo

# TensorFlow keeps graphs and Keras models for the life of a process: its
# tests run in a process of their own, so no single process holds the
# memory of the whole suite. The compiled real-model sweep runs in a process
# of its own too, so that Dynamo's caches start empty for it
test: $(STAMP)
	$(BIN)/python -m pytest -q --ignore=tests/tensorflow --ignore=tests/pytorch/test_compiled_sweep.py
	$(BIN)/python -m pytest -q tests/pytorch/test_compiled_sweep.py
	$(BIN)/python -m pytest -q tests/tensorflow

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

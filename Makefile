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

.PHONY: demo test test-core sweep bench clean wheel-smoke figures

# pip's output goes to $(VENV)/install.log, shown only when the install fails
$(STAMP): pyproject.toml constraints.txt
	@echo "setting up $(VENV): every extra and the test tools (log: $(VENV)/install.log)"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@{ $(PIP) --upgrade pip setuptools wheel && \
	   $(PIP) -e ".[torch,tensorflow,onnx,graph,dev]"; } > $(VENV)/install.log 2>&1 || \
	   { cat $(VENV)/install.log; exit 1; }
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/amanda demo

# TensorFlow keeps graphs and Keras models for the life of a process: its
# tests run in a process of their own, so no single process holds the
# memory of the whole suite. The compiled real-model sweep runs in a process
# of its own too, so that Dynamo's caches start empty for it.
# The TensorFlow process runs beside the PyTorch ones (most of the suite's
# time is one Python thread; on 2 cores the two take about what the longer
# takes alone); its output follows theirs, from build/test-tensorflow.log.
TF_LOG := build/test-tensorflow.log
test: $(STAMP) test-core
	@mkdir -p build
	@echo "tests/tensorflow runs beside the PyTorch tests (log: $(TF_LOG))"
	@$(BIN)/python -m pytest -q --durations=15 tests/tensorflow > $(TF_LOG) 2>&1 & tf=$$!; \
	status=0; \
	$(BIN)/python -m pytest -q --durations=15 --ignore=tests/tensorflow \
		--ignore=tests/pytorch/test_compiled_sweep.py || status=1; \
	$(BIN)/python -m pytest -q --durations=5 tests/pytorch/test_compiled_sweep.py || status=1; \
	wait $$tf || status=1; \
	echo "== tests/tensorflow ($(TF_LOG))"; cat $(TF_LOG); \
	exit $$status

# The whole corpora of the sweeps that `make test` samples to stay within
# CI's time: the whole eager harness, ResNet-50 compiled under the FLOPs
# and pruning tools, the compiled training step of all nine families, every onnx node-test case (7.4 minutes alone) and every Keras
# application of the TF sweeps (identity, layers, and the training steps
# with the update inside the function; the longest part), and every class
# of Keras's layer corpus
sweep: $(STAMP)
	AMANDA_TORCH_SWEEP=1 $(BIN)/python -m pytest -q tests/pytorch/test_eager_harness.py \
		tests/pytorch/test_compiled_values.py tests/pytorch/test_compiled_families.py
	AMANDA_NODE_SWEEP_SAMPLE=1 $(BIN)/python -m pytest -q tests/onnx/test_node_sweep_onnx.py
	AMANDA_KERAS_SWEEP=1 $(BIN)/python -m pytest -q tests/tensorflow/test_identity_sweep_tf.py \
		tests/tensorflow/test_keras_layers_tf.py tests/tensorflow/test_training_step_tf.py \
		tests/tensorflow/test_keras_layer_corpus_tf.py

# The framework-free tests (the IR, the passes and a toy backend, the
# structure rules) in a venv of their own with amanda's core and the test
# tools only: it checks first that no framework is importable there.
CORE := build/venv-core
FREE_TESTS := tests/ir tests/passes tests/test_structure.py tests/test_layering.py tests/test_loc.py
test-core:
	@mkdir -p build
	@test -x $(CORE)/bin/python || $(PYTHON) -m venv $(CORE)
	@$(CORE)/bin/pip install --quiet --disable-pip-version-check -c constraints.txt \
		-e . pytest hypothesis > $(CORE).log 2>&1 || { cat $(CORE).log; exit 1; }
	$(CORE)/bin/python -c "import importlib.util as u, sys; \
		found = [m for m in ('torch', 'tensorflow', 'onnx', 'onnxruntime') if u.find_spec(m)]; \
		print('framework-free venv:', found or 'no framework'); sys.exit(bool(found))"
	$(CORE)/bin/python -m pytest -q -p no:cacheprovider $(FREE_TESTS)

# The package as a user gets it: build the sdist and wheel, install the wheel
# with only the torch extra into a fresh venv (through constraints.txt, so
# torch stays the CPU wheel), then run the command from outside the checkout:
# one real command, and the one-line hint of an extra that is not installed.
SMOKE := build/wheel-smoke
wheel-smoke: $(STAMP)
	rm -rf dist $(SMOKE) && mkdir -p build
	$(BIN)/python -m build --outdir dist . > $(SMOKE).log 2>&1 || (cat $(SMOKE).log; exit 1)
	ls dist/*.whl dist/*.tar.gz
	$(PYTHON) -m venv $(SMOKE)
	$(SMOKE)/bin/pip install --quiet --disable-pip-version-check -c constraints.txt \
		"$$(ls dist/*.whl)[torch]" > $(SMOKE)-install.log 2>&1 || \
		{ cat $(SMOKE)-install.log; exit 1; }
	cd $(SMOKE) && bin/amanda flops cnn --out out > flops.txt && grep -q "^total" flops.txt
	cd $(SMOKE) && { bin/amanda quantize cnn --export out/cnn.onnx --out out 2> hint.txt; \
		test $$? = 2; } && cat hint.txt && test "$$(wc -l < hint.txt)" = 1 && \
		grep -q "pip install 'amanda-instrument\[onnx\]'" hint.txt && \
		test ! -e out/quantization.json
	@echo "wheel-smoke: ok"

# The pictures of docs/cli.md, drawn by the command itself: the Graphviz PNG
# of `amanda graph`, a headless-Chromium screenshot of its HTML fallback, and
# the `amanda flops --chart` bars (needs Graphviz's dot and chromium:
# apt-get install graphviz chromium)
FIGURES := build/figures
figures: $(STAMP)
	rm -rf $(FIGURES) && mkdir -p $(FIGURES)
	$(BIN)/python -m amanda.cli graph cnn --formats png,html --out $(FIGURES) > /dev/null
	cp $(FIGURES)/graph.png docs/figures/graph-cnn.png
	chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1400,1000 \
		--screenshot=$(CURDIR)/docs/figures/graph-cnn-html.png \
		file://$(CURDIR)/$(FIGURES)/graph.html 2> /dev/null
	$(BIN)/python -m amanda.cli flops cnn bert --chart --out $(FIGURES) > /dev/null
	cp $(FIGURES)/flops-cnn.png $(FIGURES)/flops-bert.png docs/figures/

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build dist

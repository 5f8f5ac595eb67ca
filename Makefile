# medserve: `make demo` runs the app on the embedded demo study; `make test` runs the whole suite.
# Both set up whatever is missing first (a .venv/ with the pinned stack and medserve in editable mode).
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.medserve-installed
# Holoscan warns and may fail on deep graphs below a 32 MB stack.
RUN := ulimit -s 32768 2>/dev/null || true;

.PHONY: setup system-deps demo test bench bench-server bench-map bench-gpu serve train-demo clean

setup: $(STAMP)

$(STAMP): requirements.txt requirements-nodeps.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -c 'import ensurepip' 2>/dev/null || bash .ci/system-deps python3.11-venv
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps -r requirements-nodeps.txt
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $@

# System tools the tests use (DICOM validator, containers, registry, Orthanc): installs the missing ones from
# Debian (as root, or through sudo); does nothing when all are there.
system-deps:
	bash .ci/system-deps

demo: setup
	$(RUN) $(BIN)/python -m medserve.demo

test: system-deps setup
	$(RUN) $(BIN)/python -m pytest -q

bench: setup
	$(RUN) $(BIN)/python bench/bench_pipeline.py

bench-server: setup
	$(RUN) $(BIN)/python bench/bench_server.py

bench-map: setup
	$(RUN) $(BIN)/python bench/bench_map.py

# The shared core on CUDA against the CPU (CPU cases only where there is no GPU).
bench-gpu: setup
	$(RUN) $(BIN)/python bench/bench_gpu.py

serve: setup
	$(RUN) $(BIN)/medserve serve

# Retrains the demo bundle's weights on generated phantoms (a few minutes on 2 cores).
train-demo: setup
	$(RUN) $(BIN)/python -m medserve.demo.train

clean:
	rm -rf output .medserve .pytest_cache

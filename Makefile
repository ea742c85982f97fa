# Set-up and the two jobs of the README: `make run` (the main job on CPU) and `make test` (the whole suite).
# Everything lives in a local .venv; torch is installed first as the CPU build (a bare `torch` requirement
# would pull a multi-GB CUDA build), then the package with its dev extra.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
QUICKSTART := .cache/quickstart.jsonl

.PHONY: setup run test clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/python -m parallelism_calc xxl --fsdp 16 --tp 4
	@mkdir -p .cache && rm -f $(QUICKSTART)
	$(BIN)/python -m torch_impl.bench.e2e --model tiny --suite quickstart --save-weights .cache/tiny.npz --out $(QUICKSTART)
	$(BIN)/python -m jax_impl.bench.e2e --model tiny --suite quickstart --load-weights .cache/tiny.npz --out $(QUICKSTART)
	$(BIN)/python -m analysis.reports table $(QUICKSTART) --columns backend,implementation,model,batch_size,seq_len,dtype,mode,median_ms,std_ms,tokens_per_s,tflops --metrics loss_first,loss_last

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .cache .pytest_cache

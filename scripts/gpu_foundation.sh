#!/usr/bin/env bash
# The foundation's GPU run (device machine, from the source tree): the whole test suite with the
# gpu-marked tests, then the e2e step benchmark of both backends on the same spec, batch and precision.
#   RESULTS_GIT_COMMIT=<commit> bash scripts/gpu_foundation.sh OUT_DIR
#     -> OUT_DIR/{pytest.log, foundation.jsonl, foundation.md}
# (the device machine gets the tree without its git history, so the commit is passed in for provenance)
set -uo pipefail
out=${1:?usage: scripts/gpu_foundation.sh OUT_DIR}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -m pytest -q -rs tests 2>&1 | tee "$out/pytest.log" | tail -n 15
runs="$out/foundation.jsonl"
for shape in "4 512" "16 1024"; do
  read -r batch seq <<<"$shape"
  flags=(--model small --batch-size "$batch" --seq-len "$seq" --mode train_step --dtype bf16 --warmup 5 --steps 20
         --suite foundation --out "$runs")
  for attention in naive sdpa; do python3 -m torch_impl.bench.e2e "${flags[@]}" --attention "$attention"; done
  for attention in naive dot_product; do python3 -m jax_impl.bench.e2e "${flags[@]}" --attention "$attention"; done
done
python3 -m analysis.reports table "$runs" --out "$out/foundation.md" \
  --columns backend,implementation,model,batch_size,seq_len,dtype,mode,median_ms,std_ms,tokens_per_s,tflops,mfu,peak_memory_bytes \
  --metrics loss_first,loss_last

#!/usr/bin/env bash
# FlashAttention on the device machine: bf16/fp16 correctness of the Triton kernels against fp64, then the
# leaderboard configuration against cuDNN / flash / efficient SDPA and FlexAttention in the same run.
#   RESULTS_GIT_COMMIT=<commit> bash scripts/gpu_flash.sh OUT_DIR
#     -> OUT_DIR/attention_leaderboard_h100.{jsonl,md} and its plots
set -uo pipefail
out=${1:?usage: scripts/gpu_flash.sh OUT_DIR}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
python3 scripts/flash_probe.py --no-bench
python3 -m torch_impl.bench.attention --preset leaderboard \
  --providers flash_triton,sdpa_cudnn,sdpa_flash,sdpa_efficient,flex --out "$out/attention_leaderboard_h100.jsonl"

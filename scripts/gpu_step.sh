#!/usr/bin/env bash
# The one-GPU training step against the stock reference (issue 12), one device call per phase:
#   RESULTS_GIT_COMMIT=<commit> bash scripts/gpu_step.sh OUT_DIR xl|2.7B
# Per configuration (xl: 4 x 512 and 4 x 2,048; 2.7B: 2 x 2,048; bf16 autocast, fused AdamW, cuDNN SDPA) two
# processes, each timing the stock reference (plain torch.compile of the whole model) and then ours in the
# same process: ours compiled per block, then ours compiled per block with the step replayed as a CUDA graph.
# The first process also keeps ours' kernel table (torch.profiler, OUT_DIR/kernels_*.md). Records:
# OUT_DIR/e2e_h100.jsonl, each of ours with metrics.x_stock; tables regenerated into OUT_DIR/reports.
set -uo pipefail
out=${1:?usage: scripts/gpu_step.sh OUT_DIR xl|2.7B}
phase=${2:?usage: scripts/gpu_step.sh OUT_DIR xl|2.7B}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
case "$phase" in
xl) configs=("xl 4 512" "xl 4 2048") ;;
2.7B) configs=("2.7B 2 2048") ;;
*) echo "unknown phase $phase; accepted: xl, 2.7B" >&2; exit 2 ;;
esac
for config in "${configs[@]}"; do
  read -r model batch seq <<<"$config"
  run=(python3 -m torch_impl.bench.e2e --model "$model" --batch-size "$batch" --seq-len "$seq" --dtype bf16
       --attention sdpa_cudnn --stock sdpa_cudnn --compile --warmup 3 --steps 10 --out "$out/e2e_h100.jsonl")
  "${run[@]}" --profile "/tmp/profile_${model}_$seq"
  cp "/tmp/profile_${model}_$seq"/*_kernels.md "$out/" 2>/dev/null
  "${run[@]}" --cuda-graph
done
python3 -m analysis.reports "$out" --out "$out/reports"

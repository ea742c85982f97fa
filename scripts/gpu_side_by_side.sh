#!/usr/bin/env bash
# PyTorch vs JAX on the device machines (issue 7; the 1-GPU part also issue 5's MFU target), each phase one
# device call of under 10 minutes, records appended under OUT_DIR, the report regenerated at the end:
#   RESULTS_GIT_COMMIT=<commit> bash scripts/gpu_side_by_side.sh OUT_DIR single   # 1 GPU: 2.7B, 8,192 tokens/step
#   RESULTS_GIT_COMMIT=<commit> bash scripts/gpu_side_by_side.sh OUT_DIR single_jax  # the other JAX kernels
#   RESULTS_GIT_COMMIT=<commit> bash scripts/gpu_side_by_side.sh OUT_DIR mesh     # 2 or 4 GPUs: 2.7B, DP/FSDP/TP
#     -> OUT_DIR/side_by_side.jsonl, OUT_DIR/report/side_by_side.md + charts
#   RESULTS_GIT_COMMIT=<commit> bash scripts/gpu_side_by_side.sh OUT_DIR collectives  # 2+ GPUs (issue 15 item 4)
#     -> OUT_DIR/allreduce_nccl.jsonl, OUT_DIR/collectives.jsonl, OUT_DIR/collectives_vs_nccl.md
# "single": stock PyTorch's best (cuDNN SDPA + torch.compile + fused AdamW), ours (flash_triton + compile),
# and JAX with cuDNN attention, bf16, batch 4 x 2,048; "single_jax": JAX with Pallas flash attention and
# with naive attention + remat. "mesh": a 1-GPU baseline at the
# per-GPU batch, then torch DDP / FSDP / FSDP2 (torchrun) and JAX DP / FSDP / TP (FSDP x TP on 4+ GPUs) over
# all GPUs, on 2.7B (MESH_MODEL overrides; TP needs a head count the GPU count divides; MESH_COMPILE=1 compiles
# the PyTorch runs' blocks). "collectives": in one call, PyTorch's NCCL all-reduce (torchrun, one process
# a GPU) and the JAX collectives over all GPUs, stock and with --xla-options tuned, then each JAX bus bandwidth
# (measured op and raw loop) over NCCL's at the same size: the 10% comparison of issue 15 item 4.
set -uo pipefail
out=${1:?usage: scripts/gpu_side_by_side.sh OUT_DIR single|single_jax|mesh|collectives}
phase=${2:?usage: scripts/gpu_side_by_side.sh OUT_DIR single|single_jax|mesh|collectives}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
runs="$out/side_by_side.jsonl"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
case "$phase" in
single)
  flags=(--model 2.7B --batch-size 4 --seq-len 2048 --dtype bf16 --warmup 5 --steps 10 --suite side_by_side --out "$runs")
  weights=/tmp/side_by_side_init.npz  # every run from the same weights, so the loss curves overlay
  python3 -m torch_impl.bench.e2e "${flags[@]}" --attention sdpa_cudnn --compile --fused-adamw on \
    --save-weights "$weights"
  python3 -m torch_impl.bench.e2e "${flags[@]}" --attention flash_triton --compile --fused-adamw on
  python3 -m jax_impl.bench.e2e "${flags[@]}" --attention dot_product_cudnn --remat full --load-weights "$weights"
  rm -f "$weights"
  ;;
single_jax)
  flags=(--model 2.7B --batch-size 4 --seq-len 2048 --dtype bf16 --warmup 5 --steps 10 --suite side_by_side --out "$runs")
  python3 -m jax_impl.bench.e2e "${flags[@]}" --attention pallas_flash
  python3 -m jax_impl.bench.e2e "${flags[@]}" --attention naive --remat
  ;;
mesh)
  # 2.7B (32 heads: tp = 2 or 4 divides them; xl's 25 do not), batch 4 x 512 per GPU, cuDNN attention in both.
  n=$(nvidia-smi -L | wc -l)
  model=${MESH_MODEL:-2.7B}
  flags=(--model "$model" --seq-len 512 --dtype bf16 --warmup 3 --steps 10 --suite side_by_side --out "$runs")
  python3 -m torch_impl.bench.e2e "${flags[@]}" --batch-size 4 --attention sdpa_cudnn ${MESH_COMPILE:+--compile}
  python3 -m jax_impl.bench.e2e "${flags[@]}" --batch-size 4 --attention dot_product_cudnn
  timeout 300 torchrun --standalone --nproc_per_node "$n" -m torch_impl.bench.ddp --model "$model" --seq-len 512 \
    --dtype bf16 --batch-size 4 --dist bucketed,torch_ddp,fsdp,fsdp2 --bucket-mb 25 --attention sdpa_cudnn \
    ${MESH_COMPILE:+--compile} --out "$runs"
  meshes=("dp=$n" "fsdp=$n" "tp=$n")
  [ "$n" -ge 4 ] && meshes+=("fsdp=$((n / 2)),tp=2")
  for mesh in "${meshes[@]}"; do
    timeout 150 python3 -m jax_impl.bench.e2e "${flags[@]}" --batch-size $((4 * n)) --attention dot_product_cudnn \
      --mesh "$mesh"
  done
  ;;
collectives)
  n=$(nvidia-smi -L | wc -l)
  sizes=1MB,10MB,100MB,1GB
  torchrun --standalone --nproc_per_node "$n" -m torch_impl.bench.allreduce --backend nccl --sizes "$sizes" \
    --out "$out/allreduce_nccl.jsonl"
  for xla in stock tuned; do
    python3 -m jax_impl.bench.collectives --mesh "fsdp=$n" --axis fsdp --sizes "$sizes" --xla-options "$xla" \
      --out "$out/collectives.jsonl"
  done
  python3 -m jax_impl.bench.collectives --report-only "$out/collectives.jsonl" --nccl "$out/allreduce_nccl.jsonl" \
    | tee "$out/collectives_vs_nccl.md"
  ;;
*) echo "unknown phase $phase; accepted: single, single_jax, mesh, collectives" >&2; exit 2 ;;
esac
[ "$phase" = collectives ] || python3 -m analysis.side_by_side "$runs" --out "$out/report"  # training records only

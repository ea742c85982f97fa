#!/usr/bin/env bash
# The single-GPU studies (issue 22), one phase per device call (each under 10 minutes); records go to
# OUT_DIR/<suite>.jsonl (commit them to results/, then `python -m analysis.reports results`):
#   RESULTS_GIT_COMMIT=<commit> bash scripts/gpu_single_gpu.sh OUT_DIR sweep|memory|kernels|checkpointing|attention
# sweep: train step of small ... 2.7B x context 128 ... 1024 (batch 4, bf16, SDPA); memory: 2.7B at context
# 128 / 256 / 512, fp32 and bf16, forward and train step, with allocator snapshots of the bf16 train step;
# kernels: torch.profiler kernel shares of forward vs train step; checkpointing: 2.7B, batch 4 x 2,048, bf16,
# every k flat and nested; attention: the naive attention sweep (eager and compiled). The MFU target's
# run (2.7B at 8,192 tokens per step against stock PyTorch's best) is scripts/gpu_side_by_side.sh single.
set -uo pipefail
out=${1:?usage: scripts/gpu_single_gpu.sh OUT_DIR PHASE}
phase=${2:?usage: scripts/gpu_single_gpu.sh OUT_DIR sweep|memory|kernels|checkpointing|attention}
set -- "$@" "" ""  # the optional arguments of a phase, blank when not given
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
e2e=(python3 -m torch_impl.bench.e2e --warmup 3 --steps 5)
case "$phase" in
sweep)  # sweep [eager|compiled] [fp32,bf16]: one record file per (dtype, eager / compiled)
  how=${3:-eager}; [[ $how == eager || $how == compiled ]] || { echo "sweep eager|compiled, not $how" >&2; exit 2; }
  dtypes=${4:-fp32,bf16}
  for dtype in ${dtypes//,/ }; do
    flags=(); [[ $how == compiled ]] && flags=(--compile)
    "${e2e[@]}" --sweep-models "${SWEEP_MODELS:-small,medium,large,xl,2.7B}" \
      --sweep-seq-lens "${SWEEP_SEQ_LENS:-128,256,512,1024,2048}" --batch-size 4 \
      --dtype "$dtype" --attention sdpa "${flags[@]}" --process-per model --config-timeout 150 --suite e2e_sweep \
      --out "$out/e2e_sweep_${dtype}_${how}.jsonl"
  done ;;
memory)
  for seq in 128 256 512; do for dtype in fp32 bf16; do for mode in forward train_step; do
    snapshot=(); [[ $dtype == bf16 && $mode == train_step ]] && snapshot=(--memory-snapshot "$out/memory_2.7B_$seq.pickle")
    "${e2e[@]}" --model 2.7B --batch-size 4 --seq-len "$seq" --dtype "$dtype" --mode "$mode" --attention sdpa \
      "${snapshot[@]}" --suite memory --out "$out/memory.jsonl"
  done; done; done ;;
kernels)
  for model in small xl; do for mode in forward train_step; do
    "${e2e[@]}" --model "$model" --batch-size 4 --seq-len 512 --dtype bf16 --mode "$mode" --attention sdpa \
      --profile "$out/profiles" --suite kernels --out "$out/kernels.jsonl"
  done; done ;;
checkpointing)
  ckpt=(--model 2.7B --batch-size 4 --seq-len 2048 --dtype bf16 --attention flash_triton --suite checkpointing
        --out "$out/checkpointing.jsonl")
  "${e2e[@]}" "${ckpt[@]}"
  for k in 1 2 4 8; do "${e2e[@]}" "${ckpt[@]}" --ac-every "$k"; done
  for k in 2 4 8; do "${e2e[@]}" "${ckpt[@]}" --ac-every "$k" --nested-checkpoint; done ;;
attention)
  python3 -m torch_impl.bench.naive_attention --out "$out/naive_attention.jsonl" ;;
*) echo "unknown phase $phase; accepted: sweep, memory, kernels, checkpointing, attention" >&2; exit 2 ;;
esac

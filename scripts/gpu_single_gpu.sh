#!/usr/bin/env bash
# The single-GPU studies (issue 22), one phase per device call (each under 10 minutes); records go to
# OUT_DIR/<suite>.jsonl (commit them to results/, then `python -m analysis.reports results`):
#   RESULTS_GIT_COMMIT=<commit> bash scripts/gpu_single_gpu.sh OUT_DIR PHASE [ARGS]
# sweep [eager|compiled] [fp32,bf16]: forward / backward / step of small ... 2.7B x context 128 ... 2,048 (batch 4,
# SDPA; SWEEP_MODELS, SWEEP_SEQ_LENS narrow it); kernels: kernel shares (eager, 4 x 512), the attention's matmuls
# against its softmax, the mixed-precision experiments; memory: 2.7B peaks by context, fp32 / bf16, forward / step,
# with two allocator snapshots; checkpointing: 2.7B, 4 x 2,048, bf16, our kernel, every k flat and nested;
# attention: the naive attention sweep (eager and compiled); train: a short training run of small. The answer
# pages: analysis.answers (notes/single_gpu_studies.md says which call made what).
set -uo pipefail
out=${1:?usage: scripts/gpu_single_gpu.sh OUT_DIR PHASE}
phase=${2:?usage: scripts/gpu_single_gpu.sh OUT_DIR sweep|memory|kernels|checkpointing|attention|train}
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
memory)  # 2.7B, batch 4: peak memory by context, fp32 / bf16, forward / train step; allocator snapshots at 512
  for dtype in fp32 bf16; do for mode in forward train_step; do
    "${e2e[@]}" --sweep-models 2.7B --sweep-seq-lens 128,256,512,1024 --process-per model --batch-size 4 \
      --dtype "$dtype" --mode "$mode" --attention sdpa --suite memory --out "$out/memory.jsonl"
  done; done
  for mode in forward train_step; do  # the snapshots (pytorch.org/memory_viz), two steps recorded, gzipped
    "${e2e[@]}" --model 2.7B --batch-size 4 --seq-len 512 --dtype fp32 --mode "$mode" --attention sdpa --steps 2 \
      --memory-snapshot "$out/memory_2.7B_512_fp32_$mode.pickle" --suite memory_snapshot --out "$out/memory.jsonl"
    gzip -f "$out/memory_2.7B_512_fp32_$mode.pickle"
  done ;;
kernels)  # the profiling questions: kernel shares (eager, 4 x 512), attention's parts, mixed precision
  profiles=${TMPDIR:-/tmp}/single_gpu_profiles
  for run in small:fp32:forward small:fp32:train_step xl:fp32:forward xl:fp32:train_step xl:bf16:train_step; do
    IFS=: read -r model dtype mode <<<"$run"
    "${e2e[@]}" --model "$model" --batch-size 4 --seq-len 512 --dtype "$dtype" --mode "$mode" --attention sdpa \
      --profile "$profiles" --suite kernels --out "$out/kernels.jsonl"
  done
  tar -czf "$out/kernel_tables.tar.gz" -C "$profiles" $(cd "$profiles" && ls ./*_kernels.md)  # traces stay behind
  for dtype in fp32 bf16; do
    python3 -m torch_impl.bench.attention_parts --model xl --batch-size 4 --seq-len 512 --dtype "$dtype" \
      --out "$out/attention_parts.jsonl"
  done
  python3 -m torch_impl.bench.precision --device cuda --out "$out/precision.jsonl" ;;
checkpointing)  # 2.7B (head dim 80) with our kernel, 4 x 2,048, bf16: no checkpointing, every k flat and nested;
  # each process would autotune the kernel again: all run its first configuration that fits (the same for all k)
  export FLASH_TRITON_AUTOTUNE=${FLASH_TRITON_AUTOTUNE:-0}
  ckpt=(--model 2.7B --batch-size 4 --seq-len 2048 --dtype bf16 --attention flash_triton --suite checkpointing
        --out "$out/checkpointing.jsonl")
  "${e2e[@]}" "${ckpt[@]}"
  for k in 1 2 4 8; do "${e2e[@]}" "${ckpt[@]}" --ac-every "$k"; done
  for k in 2 4 8; do "${e2e[@]}" "${ckpt[@]}" --ac-every "$k" --nested-checkpoint; done ;;
attention)
  python3 -m torch_impl.bench.naive_attention --out "$out/naive_attention.jsonl" ;;
train)  # a short real run: small, the built-in corpus, validation each epoch, warm-up + cosine
  python3 -m torch_impl.train --model small --batch-size 16 --seq-len 512 --epochs 5 --steps-per-epoch 200 \
    --lr 1e-3 --warmup-steps 100 --dtype bf16_mixed --attention sdpa_cudnn --compile --no-progress \
    --run-name small_h100 --out "$out/train_small.jsonl" ;;
*) echo "unknown phase $phase; accepted: sweep, memory, kernels, checkpointing, attention, train" >&2; exit 2 ;;
esac

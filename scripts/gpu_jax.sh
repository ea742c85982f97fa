#!/usr/bin/env bash
# The JAX path on one GPU (issue 15), each phase one device call of under 10 minutes, records under OUT_DIR:
#   RESULTS_GIT_COMMIT=<commit> bash scripts/gpu_jax.sh OUT_DIR scan
#     -> OUT_DIR/jax_scan.jsonl: the scanned Flax model (stacked blocks, one lax.scan) at xl 4 x 512 and
#        4 x 2,048 and 2.7B 2 x 2,048 under every remat policy, with init_s and compile_s next to the step;
#        then xl 4 x 512 twice through a persistent compilation cache (cold, then warm).
#   RESULTS_GIT_COMMIT=<commit> bash scripts/gpu_jax.sh OUT_DIR profile
#     -> OUT_DIR/jax_profile.jsonl and OUT_DIR/*_kernels.md: the step's GPU time by kernel (jax.profiler),
#        with PROFILE_XLA_FLAGS="--opt=a --opt=b" set, instead: xl 4 x 2,048 under each option alone, and with
#        no option first (OUT_DIR/jax_xla_flags.jsonl).
#   RESULTS_GIT_COMMIT=<commit> bash scripts/gpu_jax.sh OUT_DIR records
#     -> OUT_DIR/jax_vs_torch.jsonl: the best PyTorch step and the scanned JAX step in one call (below).
#   RESULTS_GIT_COMMIT=<commit> bash scripts/gpu_jax.sh OUT_DIR per_block
#     -> OUT_DIR/jax_per_block.jsonl and a kernel table: the blocks run one program at a time from the host
#        (--block-loop per_block) against the scan and the best PyTorch step, in one call (below).
#   RESULTS_GIT_COMMIT=<commit> [XLA_SETS="--a=1;--b=2"] bash scripts/gpu_jax.sh OUT_DIR per_block_profile
#     -> OUT_DIR/jax_per_block_profile.jsonl and one kernel table per run: where the per-block step's time goes
#        (kernels by category, the GPU's idle gaps) at xl 4 x 2,048 and 2.7B 2 x 2,048, PyTorch's best beside it.
#   RESULTS_GIT_COMMIT=<commit> bash scripts/gpu_jax.sh OUT_DIR parity
#     -> OUT_DIR/jax_parity.jsonl: both backends' losses from the same initial xl weights (below).
#   RESULTS_GIT_COMMIT=<commit> bash scripts/gpu_jax.sh OUT_DIR layout
#     -> OUT_DIR/jax_layout.jsonl: scanned against unrolled blocks at xl 4 x 2,048 (below).
#   RESULTS_GIT_COMMIT=<commit> bash scripts/gpu_jax.sh OUT_DIR mixed
#     -> OUT_DIR/jax_mixed.jsonl: bf16 weights with float32 masters under the remat policies (below).
#   RESULTS_GIT_COMMIT=<commit> bash scripts/gpu_jax.sh OUT_DIR trainers
#     -> OUT_DIR/train_jax_vs_torch.jsonl: both training loops from the same weights on the same data (below).
#   RESULTS_GIT_COMMIT=<commit> XLA_SETS="--a=1 --b=2;--c=3" bash scripts/gpu_jax.sh OUT_DIR xla
#     -> OUT_DIR/jax_xla.jsonl: the xl step under each set of XLA options, with its kernel table (below).
#   RESULTS_GIT_COMMIT=<commit> [FIDELITY_SET=1|2|3|4] bash scripts/gpu_jax.sh OUT_DIR fidelity
#     -> OUT_DIR/jax_fidelity.jsonl: every step the fidelity report had no profile for, profiled (kernel time by
#        category, the GPU's idle time: evidence for analysis.fidelity.explain_kernels); set 1 the scanned xl and
#        2.7B steps, set 2 the xl 4 x 512 and small ones, set 3 2.7B under two more policies, set 4 the
#        trainers' small 8 x 512 step (all, if unset).
# Every run is its own process (a fresh JAX: init and compile times are what a user waits for) under a time
# limit, so one that hangs or runs out of memory leaves a row (the benchmark records failures) and the rest run.
set -uo pipefail
phases="scan|profile|records|per_block|per_block_profile|parity|layout|mixed|trainers|xla|fidelity"
usage="usage: scripts/gpu_jax.sh OUT_DIR $phases"
out=${1:?$usage}
phase=${2:?$usage}
mkdir -p "$out"
# JAX's allocator may take 95% of the GPU (its default is 75%, which left 2.7B's remat policies short of
# memory that PyTorch's allocator may use); it grows as needed rather than taking it all at the start.
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
torch_best() {  # torch_best MODEL BATCH SEQ SUITE OUT: PyTorch's best step (bf16 weights with fp32 masters,
  # compiled in spans of blocks, each span's CUDA graph)
  timeout 240 python3 -m torch_impl.bench.e2e --model "$1" --batch-size "$2" --seq-len "$3" --dtype bf16_mixed \
    --attention sdpa_cudnn --compile --cuda-graph blocks --warmup 3 --steps 10 --suite "$4" --out "$5"
}
jax_e2e() {  # jax_e2e SECONDS ARGS...: one benchmark process, its wall time printed
  local limit=$1 start=$SECONDS
  shift
  timeout "$limit" python3 -m jax_impl.bench.e2e --dtype bf16 --attention dot_product_cudnn "$@" \
    || echo "exit $? after $((SECONDS - start)) s: $*"
  echo "wall $((SECONDS - start)) s: $*"
}
case "$phase" in
fidelity)
  # The configurations of the committed JAX step records the fidelity report had no profile of, each profiled
  # (--profile: time_ms.<category>, gpu_busy_ms, gpu_idle_ms in its record; the trace itself not kept).
  [[ "${FIDELITY_SET:-1}" =~ ^[1-4]$ ]] || { echo "FIDELITY_SET=$FIDELITY_SET: 1 to 4 (unset: all)" >&2; exit 2; }
  runs="$out/jax_fidelity.jsonl"
  common=(--warmup 3 --steps 10 --suite jax_fidelity --out "$runs")
  profiled() { jax_e2e "$@" "${common[@]}" --profile "$out/profile"; rm -rf "$out/profile"; }
  if [ "${FIDELITY_SET:-1}" = 1 ]; then
    for remat in dots_attention qkv_mlp_norms; do
      profiled 150 --model xl --batch-size 4 --seq-len 2048 --dtype bf16_mixed --remat "$remat"
    done
    for remat in qkv_mlp full; do
      profiled 150 --model 2.7B --batch-size 2 --seq-len 2048 --dtype bf16_mixed --remat "$remat"
    done
    profiled 150 --model xl --batch-size 4 --seq-len 2048 --remat full
    profiled 150 --model 2.7B --batch-size 2 --seq-len 2048 --remat full
  fi
  if [ "${FIDELITY_SET:-3}" = 3 ]; then
    for remat in dots_attention qkv_mlp_norms; do
      profiled 150 --model 2.7B --batch-size 2 --seq-len 2048 --dtype bf16_mixed --remat "$remat"
    done
  fi
  if [ "${FIDELITY_SET:-4}" = 4 ]; then  # the trainers' step (jax_impl.trainer, small 8 x 512)
    profiled 120 --model small --batch-size 8 --seq-len 512 --dtype bf16_mixed
  fi
  if [ "${FIDELITY_SET:-2}" = 2 ]; then
    profiled 120 --model xl --batch-size 4 --seq-len 512 --dtype bf16_mixed --remat dots_attention
    profiled 120 --model xl --batch-size 4 --seq-len 512 --remat dots_attention
    profiled 120 --model xl --batch-size 4 --seq-len 512 --dtype bf16_mixed --block-loop per_block \
      --blocks-per-program 4
    for shape in "4 512" "16 1024"; do  # the foundation's JAX steps (scripts/gpu_foundation.sh)
      read -r batch seq <<<"$shape"
      for attention in naive dot_product; do
        profiled 120 --model small --batch-size "$batch" --seq-len "$seq" --attention "$attention"
      done
    done
  fi
  ;;
scan)
  runs="$out/jax_scan.jsonl"
  common=(--warmup 3 --steps 10 --suite jax_scan --out "$runs")
  for remat in none dots dots_attention full; do
    jax_e2e 150 --model xl --batch-size 4 --seq-len 2048 --remat "$remat" "${common[@]}"
  done
  for remat in dots_attention full; do
    jax_e2e 150 --model 2.7B --batch-size 2 --seq-len 2048 --remat "$remat" "${common[@]}"
  done
  for remat in none dots_attention; do
    jax_e2e 120 --model xl --batch-size 4 --seq-len 512 --remat "$remat" "${common[@]}"
  done
  for cache in cold warm; do
    JAX_COMPILATION_CACHE_DIR="$out/.jax_cache" jax_e2e 120 --model xl --batch-size 4 --seq-len 512 \
      --remat dots_attention --warmup 1 --steps 3 --suite "jax_scan_cache_$cache" --out "$runs"
  done
  rm -rf "$out/.jax_cache"
  ;;
profile)
  if [ -n "${PROFILE_XLA_FLAGS:-}" ]; then  # only the step under each XLA option (the profiled runs are done)
    for flags in "" $PROFILE_XLA_FLAGS; do
      XLA_FLAGS="$flags" jax_e2e 200 --model xl --batch-size 4 --seq-len 2048 --remat dots_attention \
        --warmup 3 --steps 10 --suite jax_xla_flags --out "$out/jax_xla_flags.jsonl"
    done
    exit 0
  fi
  # Where the scanned step's time goes (kernel tables by category under OUT_DIR/profile).
  runs="$out/jax_profile.jsonl"
  common=(--warmup 3 --steps 10 --suite jax_profile --out "$runs")
  jax_e2e 150 --model xl --batch-size 4 --seq-len 2048 --remat dots "${common[@]}"
  jax_e2e 150 --model xl --batch-size 4 --seq-len 2048 --remat dots_attention "${common[@]}" --profile "$out/profile"
  jax_e2e 150 --model xl --batch-size 4 --seq-len 512 --remat none "${common[@]}" --profile "$out/profile"
  jax_e2e 150 --model xl --batch-size 4 --seq-len 512 --remat dots_attention "${common[@]}"
  jax_e2e 150 --model 2.7B --batch-size 2 --seq-len 2048 --remat dots "${common[@]}"
  cp "$out"/profile/*_kernels.md "$out"/ 2>/dev/null
  rm -rf "$out/profile"
  ;;
records)
  # The issue's records in one call: the best PyTorch step (ours, bf16 weights with fp32 masters, compiled in
  # spans of blocks, each span's CUDA graph) and the JAX step, with bf16 weights and fp32 masters too, at xl
  # 4 x 2,048 and 2.7B 2 x 2,048: its blocks run by the host (--block-loop per_block), one program per block and
  # per span of 4, saving what qkv_mlp_norms_product names, and the scan beside them; then the per-block step at xl
  # 4 x 512 (init and compile; the host's share) (OUT_DIR/jax_vs_torch.jsonl; each run's output in
  # OUT_DIR/records.log).
  runs="$out/jax_vs_torch.jsonl"
  common=(--dtype bf16_mixed --warmup 8 --steps 10 --suite jax_vs_torch --out "$runs")  # 7 synced steps (metric)
  {
    torch_best xl 4 2048 jax_vs_torch "$runs"
    jax_e2e 150 --model xl --batch-size 4 --seq-len 2048 --remat dots_attention "${common[@]}"
    for span in 1 4; do
      jax_e2e 150 --model xl --batch-size 4 --seq-len 2048 --remat qkv_mlp_norms_product --block-loop per_block \
        --blocks-per-program "$span" "${common[@]}"
    done
    torch_best 2.7B 2 2048 jax_vs_torch "$runs"
    jax_e2e 150 --model 2.7B --batch-size 2 --seq-len 2048 --remat qkv_mlp "${common[@]}"
    for span in 1 4; do
      jax_e2e 150 --model 2.7B --batch-size 2 --seq-len 2048 --remat qkv_mlp_norms_product --block-loop per_block \
        --blocks-per-program "$span" "${common[@]}"
    done
    jax_e2e 120 --model xl --batch-size 4 --seq-len 512 --remat none --block-loop per_block --blocks-per-program 4 \
      "${common[@]}"
  } > "$out/records.log" 2>&1
  grep -E "^(jax|torch) |ms/step|^exit|^wall" "$out/records.log"
  ;;
per_block)
  # The blocks as one program each, called by the host (--block-loop per_block: no stacks, so none of the scan's
  # copies), against the scan and PyTorch's best step in the same call, bf16 weights with fp32 masters, at
  # xl 4 x 2,048 under the remat policies (none may fit without stacks), then xl 4 x 512 (is the host fast
  # enough?) and 2.7B 2 x 2,048; the kernel table of the per-block xl step (OUT_DIR/jax_per_block.jsonl).
  runs="$out/jax_per_block.jsonl"
  common=(--dtype bf16_mixed --warmup 3 --steps 10 --suite jax_per_block --out "$runs")
  xl=(--model xl --batch-size 4 --seq-len 2048)
  torch_best xl 4 2048 jax_per_block "$runs"
  jax_e2e 150 "${xl[@]}" --remat dots_attention "${common[@]}"
  jax_e2e 150 "${xl[@]}" --remat dots_attention --block-loop per_block "${common[@]}" --profile "$out/profile"
  for remat in none qkv_mlp; do
    jax_e2e 150 "${xl[@]}" --remat "$remat" --block-loop per_block "${common[@]}"
  done
  jax_e2e 120 --model xl --batch-size 4 --seq-len 512 --remat none --block-loop per_block "${common[@]}"
  jax_e2e 150 --model 2.7B --batch-size 2 --seq-len 2048 --remat qkv_mlp --block-loop per_block "${common[@]}"
  cp "$out"/profile/*_kernels.md "$out"/ 2>/dev/null
  rm -rf "$out/profile"
  ;;
per_block_profile)
  # Where the per-block step's time goes (kernels by category, and the GPU's idle gaps: does the host keep up?),
  # one and four blocks a program at xl 4 x 2,048, four at 2.7B 2 x 2,048, PyTorch's best step at both in the
  # same call; with XLA_SETS="--a=1 --b=2;--c=3" each JAX run again under each set of XLA options
  # (OUT_DIR/jax_per_block_profile.jsonl, OUT_DIR/<model>_span<N>_<set>_kernels.md with set 0 for no options,
  # each run's output in OUT_DIR/per_block_profile.log).
  runs="$out/jax_per_block_profile.jsonl"
  common=(--dtype bf16_mixed --remat qkv_mlp_norms_product --block-loop per_block --warmup 3 --steps 10
          --suite jax_per_block_profile --out "$runs")
  IFS=';' read -r -a sets <<< "${XLA_SETS:-}"
  sets=("" "${sets[@]}")
  profiled() {  # profiled NAME ARGS...: one profiled JAX run, its kernel table kept as OUT_DIR/NAME_kernels.md
    local name=$1
    shift
    jax_e2e 150 "$@" "${common[@]}" --profile "$out/profile_$name"
    cp "$out/profile_$name"/*_kernels.md "$out/${name}_kernels.md"
  }
  {
    torch_best xl 4 2048 jax_per_block_profile "$runs"
    for i in "${!sets[@]}"; do
      for span in 1 4; do
        XLA_FLAGS="${sets[$i]}" profiled "xl_span${span}_$i" --model xl --batch-size 4 --seq-len 2048 \
          --blocks-per-program "$span"
      done
    done
    torch_best 2.7B 2 2048 jax_per_block_profile "$runs"
    for i in "${!sets[@]}"; do
      XLA_FLAGS="${sets[$i]}" profiled "2.7B_span4_$i" --model 2.7B --batch-size 2 --seq-len 2048 \
        --blocks-per-program 4
    done
  } > "$out/per_block_profile.log" 2>&1
  rm -rf "$out"/profile_*
  grep -E "^(jax|torch) |ms/step|^exit|^wall" "$out/per_block_profile.log"
  ;;
parity)
  # The same starting weights in both backends (issue 15 item 3): PyTorch saves its initial xl weights, JAX loads
  # them, both take the same 12 AdamW steps on the same batch at each learning rate of PARITY_LRS (default 1e-3,
  # the benchmarks' rate, at which this one-batch run turns chaotic after a few steps, and 1e-4)
  # (OUT_DIR/jax_parity.jsonl; losses per step).
  runs="$out/jax_parity.jsonl"
  weights=/tmp/xl_init.npz
  for lr in ${PARITY_LRS:-1e-3 1e-4}; do
    timeout 200 python3 -m torch_impl.bench.e2e --model xl --batch-size 4 --seq-len 512 --dtype bf16 --lr "$lr" \
      --attention sdpa_cudnn --warmup 1 --steps 11 --suite jax_parity --save-weights "$weights" --out "$runs"
    jax_e2e 200 --model xl --batch-size 4 --seq-len 512 --remat dots_attention --warmup 1 --steps 11 --lr "$lr" \
      --suite jax_parity --load-weights "$weights" --out "$runs"
  done
  rm -f "$weights"
  ;;
layout)
  # How the blocks are laid out, at xl 4 x 2,048 (OUT_DIR/jax_layout.jsonl): one lax.scan over stacked
  # parameters (the default) against a Python loop over separate blocks, under the remat policies that fit.
  runs="$out/jax_layout.jsonl"
  common=(--model xl --batch-size 4 --seq-len 2048 --warmup 3 --steps 10 --suite jax_layout --out "$runs")
  jax_e2e 150 --remat dots_attention "${common[@]}"
  for remat in dots_attention none; do
    jax_e2e 140 --remat "$remat" --block-loop unrolled "${common[@]}"
  done
  ;;
mixed)
  # bf16 weights with float32 masters (--dtype bf16_mixed, as PyTorch's best step) and the remat policies that
  # keep named intermediates, against the bf16 step (fp32 weights, bf16 compute) at xl 4 x 2,048 and 2.7B
  # 2 x 2,048 (OUT_DIR/jax_mixed.jsonl); with MIXED_XLA_FLAGS="--opt=a --opt=b" the xl bf16_mixed qkv_mlp step
  # under each option too; the kernel table of xl bf16_mixed qkv_mlp.
  runs="$out/jax_mixed.jsonl"
  common=(--warmup 3 --steps 10 --suite jax_mixed --out "$runs")
  xl=(--model xl --batch-size 4 --seq-len 2048)
  jax_e2e 150 "${xl[@]}" --remat dots_attention "${common[@]}"
  for remat in dots_attention qkv_mlp qkv_mlp_norms none; do
    jax_e2e 150 "${xl[@]}" --dtype bf16_mixed --remat "$remat" "${common[@]}"
  done
  for flags in ${MIXED_XLA_FLAGS:-}; do
    XLA_FLAGS="$flags" jax_e2e 150 "${xl[@]}" --dtype bf16_mixed --remat qkv_mlp "${common[@]}"
  done
  for remat in full dots_attention qkv_mlp; do
    jax_e2e 150 --model 2.7B --batch-size 2 --seq-len 2048 --dtype bf16_mixed --remat "$remat" "${common[@]}"
  done
  jax_e2e 150 "${xl[@]}" --dtype bf16_mixed --remat qkv_mlp --warmup 3 --steps 10 --suite jax_mixed_profile \
    --out "$out/jax_mixed_profile.jsonl" --profile "$out/profile"
  cp "$out"/profile/*_kernels.md "$out"/ 2>/dev/null
  rm -rf "$out/profile"
  ;;
trainers)
  # Both training loops on the same data from the same initial weights (PyTorch's, saved by name), small 8 x 512,
  # bf16 weights with fp32 masters, 3 epochs of 50 steps (OUT_DIR/train_jax_vs_torch.jsonl: one record per
  # epoch each), JAX once straight and once stopped after epoch 1 and resumed from its orbax checkpoint; then
  # the optimized HLO of the JAX xl 4 x 2,048 step (OUT_DIR/jax_xl_step_hlo.txt.gz).
  runs="$out/train_jax_vs_torch.jsonl" weights=/tmp/small_init.npz
  python3 -c "import sys, numpy as np, torch; from torch_impl.model import TransformerLM; \
from parallelism_calc.specs import MODELS; torch.manual_seed(0); \
np.savez(sys.argv[1], **TransformerLM(MODELS['small']).to_numpy_weights())" "$weights"
  common=(--model small --batch-size 8 --seq-len 512 --epochs 3 --steps-per-epoch 50 --lr 1e-3 --warmup-steps 20
          --dtype bf16_mixed --val-batches 4 --init-weights "$weights" --cache-dir /tmp/data --no-progress --out "$runs")
  timeout 200 python3 -m torch_impl.train "${common[@]}" --attention sdpa_cudnn --compile --run-name torch
  timeout 120 python3 -m jax_impl.trainer "${common[@]}" --attention dot_product_cudnn --run-name jax
  for resume in "--stop-after-epochs 1" "--resume"; do
    timeout 120 python3 -m jax_impl.trainer "${common[@]}" --attention dot_product_cudnn --run-name jax_resumed \
      --checkpoint-dir /tmp/jax_ckpt $resume
  done
  rm -rf "$weights" /tmp/jax_ckpt
  jax_e2e 150 --model xl --batch-size 4 --seq-len 2048 --dtype bf16_mixed --remat dots_attention --warmup 1 \
    --steps 2 --suite jax_hlo --out "$out/jax_hlo.jsonl" --dump-hlo "$out/jax_xl_step_hlo.txt"
  gzip -f "$out/jax_xl_step_hlo.txt"
  ;;
xla)
  # XLA options on the xl 4 x 2,048 step (bf16 weights, fp32 masters, remat dots_attention), each set of
  # XLA_SETS (';'-separated; each set one XLA_FLAGS value) after none, with its kernel table
  # (OUT_DIR/jax_xla.jsonl, OUT_DIR/xla_<n>_kernels.md: where the memcpy time goes).
  IFS=';' read -ra sets <<< ";${XLA_SETS:-}"
  for n in "${!sets[@]}"; do
    XLA_FLAGS="${sets[$n]}" jax_e2e 150 --model xl --batch-size 4 --seq-len 2048 --dtype bf16_mixed \
      --remat dots_attention --warmup 3 --steps 10 --suite jax_xla --out "$out/jax_xla.jsonl" --profile "$out/p$n"
    cp "$out/p$n"/*_kernels.md "$out/xla_${n}_kernels.md" 2>/dev/null
    rm -rf "$out/p$n"
  done
  ;;
*) echo "unknown phase $phase; accepted: scan, profile, records, parity, layout, mixed, trainers, xla" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# FlashAttention v2 on the device machine (issue 14), from the source tree. Modes, in the order "all" runs them:
#   tests  the attention tests on CUDA: first the x1e3 / x1000 numerics and the custom ops (opcheck, Inductor
#          fullgraph compile) -> OUT/gpu_tests.log, then the gpu-marked real sizes -> OUT/gpu_tests_real_sizes.log;
#          fixed tiles (FLASH_TRITON_AUTOTUNE=0: the first configuration each pruning keeps, no tuning per shape);
#          every measured error printed. (All the test files in one go did not fit a 10-minute call on a cold
#          machine: Triton compiles every case's kernels.)
#   tests_small  the CPU-size cases natively (every head dim, n = 1.., GQA, strides) -> OUT/gpu_tests_small.log
#   tests_parallel  every attention test, gpu-marked and CPU-size alike, in SHARDS (default 10) pytest processes at
#          once, the test ids dealt round-robin (what takes the time is Triton compiling each case's kernels, one CPU
#          core a process; each under SHARD_TIMEOUT, default 480 s; TEST_IDS=FILE: only the ids in FILE, one a line),
#          then what failed again in one process (RERUN_TIMEOUT, default 120 s; out of memory with several processes
#          on one GPU is no verdict) -> OUT/gpu_tests_parallel.log (each shard's log in turn, the summaries, the rerun)
#   bench  (BENCH_SHAPES=... for a subset) the flash_shapes preset in one process: the issue's 1x16x16384 (d 64, 128) and 4x32x2048x64, the head-dim
#          sweep d = 64, 80, 128, 256, ISSUE_NOTES' 4x32x2048x80, 1x16x16384x80, 2x16x4096x96, 1x8x8192x256; bf16
#          causal, forward and forward+backward, ours (autotuned) vs cuDNN SDPA, flash SDPA and FlexAttention
#          -> OUT/attention_leaderboard_<gpu>.{jsonl,md} and plots
#   e2e    the 2.7B preset (head dim 80) with --attention flash_triton --compile, 2 x 2048 bf16, a few steps
#          -> OUT/e2e_flash_2.7B.jsonl (issue 14: "e2e --model 2.7B --attention flash_triton --compile runs")
#   ncu    Nsight Compute on our kernels at 1 x 16 x 16,384 x 64 (both backwards): a first run autotunes and caches the
#          choices (TRITON_CACHE_AUTOTUNING=1), the profiled run reuses them and runs each kernel once
#          -> OUT/flash_ncu.ncu-rep, its details and its per-instruction source view as text
#          (OUT/flash_ncu_details.txt, OUT/flash_ncu_source.csv), the kernels' TTGIR/PTX (OUT/flash_triton_ir.tgz)
#   gluon  the Gluon forward (torch_impl/attention/flash_gluon.py): scripts/flash_gluon_probe.py for the first
#          configuration of each head dim (a process, under timeout: a barrier deadlock hangs) and for the
#          Gluon backward (--backward: float64 checks, times against the Triton backward and cuDNN), the GPU tests
#          of the op with it (every shape it supports, x1000) -> OUT/gpu_tests_gluon.log, then ours with and
#          without it (FLASH_GLUON=0; the backward's tuning cached between the two) against cuDNN at the
#          leaderboard shapes and 4 x 32 x 2,048 (d 64, 128), forward and forward + backward
#          -> OUT/attention_gluon_{on,off}_<gpu>.jsonl
#   gluon_bench  the same without the tests
#   ncu_gluon  Nsight Compute on the first launch of the Gluon backward (the probe's variant NCU_VARIANT, default
#          gluon_64_64_3_240, the first of BWD_CONFIGS) at NCU_SHAPE (default 1x16x16384x64; the probe's float64
#          checks skipped: their launches came first), stall reasons by SASS instruction
#          -> OUT/flash_gluon_bwd_ncu_{details.txt,source.csv} (the report itself stays there: 16 MiB)
#   ncu_forward  Nsight Compute on the forwards at NCU_SHAPE (default 4x32x2048x64, where cuDNN's is 1.2x ours): the
#          Gluon forward (the probe's NCU_VARIANTS, default a program per item and persistent with O's TMA store), the
#          Triton forward and cuDNN's, each
#          launched twice (the probe's --once; Triton's tuning cached by a first run)
#          -> OUT/flash_fwd_ncu_details.txt, OUT/flash_fwd_ncu_source.csv.gz (per SASS instruction)
#   all    tests then bench (default). e2e is separate: autotuning plus compiling 2.7B may not fit the same call.
#   RESULTS_GIT_COMMIT=<commit> bash scripts/gpu_flash.sh OUT_DIR [all|tests|tests_small|tests_parallel|bench|e2e|ncu|
#                                                                gluon|gluon_bench|ncu_gluon|ncu_forward]
# Records are appended as they are measured, so a call cut short keeps what it finished.
set -uo pipefail
modes="all|tests|tests_small|tests_parallel|bench|e2e|ncu|gluon|gluon_bench|ncu_gluon|ncu_forward"
out=${1:?usage: scripts/gpu_flash.sh OUT_DIR [$modes]}
mode=${2:-all}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
source "$(dirname "$0")/gpu_tag.sh"  # GPU_TAG: h100, h200, ... in the record file names (<gpu> below)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
status=0

run_pytest() {  # log name, then pytest arguments
  FLASH_TRITON_AUTOTUNE=0 FLASH_ATTN_PRINT_ERRORS=1 python3 -m pytest -q -rs -s "${@:2}" >"$out/$1" 2>&1 || status=1
  grep -E "passed|failed|error" "$out/$1" | tail -n 3
  grep -E "^(FAILED|ERROR)" "$out/$1" | head -n 20
}

run_tests() {  # first what a cold machine's call must reach: large magnitudes (issue 17 item 5), the custom ops
  run_pytest gpu_tests.log tests/test_flash_attention.py -k "large_magnitudes or x1000 or test_flash_triton_op" \
    tests/test_flash_triton_op.py
  run_pytest gpu_tests_real_sizes.log -m gpu tests/test_flash_attention.py -k "not large_magnitudes and not x1000"
}

run_tests_small() {  # the CPU-size cases natively: every head dim, n = 1.., GQA, strides (Triton compiles per case)
  run_pytest gpu_tests_small.log -m "not gpu" tests/test_flash_attention.py -k "not large_magnitudes" \
    tests/test_bench_attention.py
}

run_tests_parallel() {
  local shards=${SHARDS:-10} ids dir
  dir=$(mktemp -d)
  if [ -n "${TEST_IDS:-}" ]; then  # a file of test ids, one a line (those a cut-short call left)
    ids=$(cat "$TEST_IDS")
  else
    ids=$(python3 -m pytest --collect-only -q tests/test_flash_attention.py tests/test_flash_triton_op.py \
      tests/test_bench_attention.py | grep '::')
  fi
  echo "$ids" | wc -l | xargs echo "tests:"
  for i in $(seq 0 $((shards - 1))); do
    mapfile -t shard < <(echo "$ids" | awk -v n="$shards" -v i="$i" 'NR % n == i')  # an id may hold spaces
    FLASH_TRITON_AUTOTUNE=0 FLASH_ATTN_PRINT_ERRORS=1 timeout "${SHARD_TIMEOUT:-480}" \
      python3 -m pytest -q -rfs -s -p no:cacheprovider "${shard[@]}" >"$dir/shard_$i.log" 2>&1 &
  done
  wait || true
  for i in $(seq 0 $((shards - 1))); do
    echo "== shard $i"; cat "$dir/shard_$i.log"; echo  # a shard cut by its timeout ends mid-line
  done >"$out/gpu_tests_parallel.log"
  grep -hE "[0-9]+ (passed|failed)" "$dir"/shard_*.log | tee -a "$out/gpu_tests_parallel.log"
  # The processes share one GPU's memory: what failed is run again in one process, whose verdict counts.
  mapfile -t failed < <(echo "$ids" | python3 -c 'import sys, glob
logs = "".join(open(f).read() for f in glob.glob(sys.argv[1] + "/shard_*.log"))
sys.stdout.write("".join(i + "\n" for i in sys.stdin.read().splitlines() if "\nFAILED " + i + " " in "\n" + logs))' \
    "$dir")
  if [ "${#failed[@]}" -gt 0 ]; then
    echo "== ${#failed[@]} failed, run again in one process" | tee -a "$out/gpu_tests_parallel.log"
    FLASH_TRITON_AUTOTUNE=0 FLASH_ATTN_PRINT_ERRORS=1 timeout "${RERUN_TIMEOUT:-120}" \
      python3 -m pytest -q -rfs -s -p no:cacheprovider "${failed[@]}" >>"$out/gpu_tests_parallel.log" 2>&1 || status=1
    tail -n 3 "$out/gpu_tests_parallel.log"
  fi
}

run_bench() {  # BENCH_SHAPES=BxHxNxd,...: only those of the preset's shapes (a call that ran out of time goes on)
  python3 -m torch_impl.bench.attention --preset flash_shapes ${BENCH_SHAPES:+--shapes "$BENCH_SHAPES"} \
    --out "$out/attention_leaderboard_${GPU_TAG}.jsonl" || status=1
}

run_e2e() {
  python3 -m torch_impl.bench.e2e --model 2.7B --batch-size 2 --seq-len 2048 --mode train_step --dtype bf16 \
    --attention flash_triton --compile --warmup 2 --steps 5 --suite flash_e2e --out "$out/e2e_flash_2.7B.jsonl" || status=1
}

run_ncu() {
  local probe=(python3 scripts/flash_probe.py "$out" --shapes 1x16x16384x64 --variants det,fused --once)
  export TRITON_CACHE_AUTOTUNING=1
  "${probe[@]}" || status=1
  ncu --clock-control none --set full --import-source yes -k 'regex:_fwd_kernel|_bwd_dkdv_kernel|_bwd_dq_kernel' \
    -f -o "$out/flash_ncu" "${probe[@]}" >"$out/flash_ncu.log" 2>&1 || status=1
  ncu -i "$out/flash_ncu.ncu-rep" --page details >"$out/flash_ncu_details.txt" 2>&1 || status=1
  # per SASS instruction of the kernels (stall reasons, where the time goes inside the loop), and the kernels
  # as Triton compiled them (TTGIR, PTX: what each tl op lowered to)
  ncu -i "$out/flash_ncu.ncu-rep" --page source --csv --print-source sass >"$out/flash_ncu_source.csv" 2>&1 || status=1
  find "${TRITON_CACHE_DIR:-$HOME/.triton/cache}" \( -name '_bwd_*.ttgir' -o -name '_bwd_*.ptx' -o -name '_bwd_*.json' \
    -o -name '_fwd_kernel.ttgir' \) -print0 | tar czf "$out/flash_triton_ir.tgz" --null -T - || status=1
  tail -n 5 "$out/flash_ncu.log"
}

run_ncu_gluon() {  # where the Gluon backward's time goes: Nsight Compute on the first launch of one variant at one
  # shape (the probe's timing runs, its float64 checks skipped), stall reasons per SASS instruction
  local probe=(python3 scripts/flash_gluon_probe.py "$out/ncu_probe" --backward --no-checks
               --shapes "${NCU_SHAPE:-1x16x16384x64}" --variants "${NCU_VARIANT:-gluon_64_64_3_240}")
  timeout 300 ncu --clock-control none --set full --import-source no -k regex:'^_bwd_kernel$' -c 1 \
    -f -o /tmp/flash_gluon_bwd_ncu "${probe[@]}" >"$out/flash_gluon_bwd_ncu.log" 2>&1 || status=1
  ncu -i /tmp/flash_gluon_bwd_ncu.ncu-rep --page details >"$out/flash_gluon_bwd_ncu_details.txt" 2>&1 || status=1
  ncu -i /tmp/flash_gluon_bwd_ncu.ncu-rep --page source --csv --print-source sass \
    >"$out/flash_gluon_bwd_ncu_source.csv" 2>&1 || status=1
  rm -rf "$out/ncu_probe"
  tail -n 3 "$out/flash_gluon_bwd_ncu.log"
}

run_ncu_forward() {
  local probe=(python3 scripts/flash_gluon_probe.py "$out/ncu_probe" --once --config 0 --shapes "${NCU_SHAPE:-4x32x2048x64}"
               --variants "${NCU_VARIANTS:-gluon,gluon_persistent_tma_store}")
  TRITON_CACHE_AUTOTUNING=1 "${probe[@]}" >/dev/null 2>&1 || status=1
  TRITON_CACHE_AUTOTUNING=1 timeout 400 ncu --clock-control none --set full --import-source no \
    -k regex:'_fwd_kernel|fprop' -f -o /tmp/flash_fwd_ncu "${probe[@]}" >"$out/flash_fwd_ncu.log" 2>&1 || status=1
  ncu -i /tmp/flash_fwd_ncu.ncu-rep --page details >"$out/flash_fwd_ncu_details.txt" 2>&1 || status=1
  ncu -i /tmp/flash_fwd_ncu.ncu-rep --page source --csv --print-source sass 2>&1 | gzip >"$out/flash_fwd_ncu_source.csv.gz"
  rm -rf "$out/ncu_probe"
  tail -n 3 "$out/flash_fwd_ncu.log"
}

run_gluon_probe() {  # the first configuration of each head dim, under timeout (a deadlock hangs); then the backward
  # (d 64 and 128) in a process of its own
  timeout 240 python3 scripts/flash_gluon_probe.py "$out" --config 0 2>&1 | grep -E "cuDNN|Error" || status=1
  timeout 240 python3 scripts/flash_gluon_probe.py "$out" --backward \
    --shapes 1x16x16384x64,4x32x2048x64,1x16x16384x128,4x32x2048x128 2>&1 |
    grep -E " ms|Error" || status=1
}

run_gluon_bench() {
  export TRITON_CACHE_AUTOTUNING=1
  local shapes=1x16x16384x64,1x16x16384x128,4x32x2048x64,4x32x2048x128
  for gluon in 1 0; do
    local name=$([ "$gluon" = 1 ] && echo on || echo off)
    FLASH_GLUON=$gluon python3 -m torch_impl.bench.attention --shapes "$shapes" --dtypes bf16 --causal \
      --providers flash_triton,sdpa_cudnn --passes forward,forward_backward --suite "flash_gluon_$name" --no-report \
      --out "$out/attention_gluon_${name}_${GPU_TAG}.jsonl" || status=1
  done
}

run_gluon() {
  run_gluon_probe
  run_pytest gpu_tests_gluon.log -m gpu tests/test_flash_attention.py \
    -k "gluon_in_the_op or x1000"
  run_gluon_bench
}

case "$mode" in
  tests) run_tests ;;
  tests_small) run_tests_small ;;
  tests_parallel) run_tests_parallel ;;
  bench) run_bench ;;
  e2e) run_e2e ;;
  ncu) run_ncu ;;
  gluon) run_gluon ;;
  gluon_bench) run_gluon_probe; run_gluon_bench ;;
  ncu_gluon) run_ncu_gluon ;;
  ncu_forward) run_ncu_forward ;;
  all) run_tests; run_bench ;;
  *) echo "unknown mode $mode; accepted: ${modes//|/, }" >&2
     exit 2 ;;
esac
exit $status

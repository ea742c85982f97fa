#!/usr/bin/env bash
# The data-parallel runs on the NCCL machines (2 or 4 GPUs), one phase per device call (each under 10 minutes);
# records go to OUT_DIR/<suite>.jsonl, then every table and chart is regenerated into OUT_DIR/reports:
#   RESULTS_GIT_COMMIT=<commit> bash scripts/gpu_distributed.sh OUT_DIR PHASE
# allreduce: NCCL all-reduce 1 MB ... 1 GB on 2 and (where there are) 4 GPUs, against a raw loop;
# ddp: xl, bf16, batch 2 x 512 per rank: one GPU alone (the scaling baseline), then every DDP variant over all GPUs;
# seed: the reference sheet's DDP run (xl, fp32, eager, 2 x 512 per rank: batch 4 over 2 GPUs);
# overlap: the step users run (xl, 4 x 1,024 per rank, bf16 autocast, cuDNN attention, compiled blocks): cuBLAS
#   with SMs left free (scripts/carveout_probe.py), one GPU, naive and torch DDP, individual and bucketed 25 MB
#   with their NCCL kernels on COMM_SMS SMs (default 0,4,8,16; 0: NCCL's own choice), then bucketed on
#   PROFILE_SMS SMs (default 8) profiled on every rank (OUT_DIR/ddp_profiles.tar.xz: a Chrome trace and a kernel
#   table per configuration and rank);
# graphs: that step with each compiled region replayed as CUDA graphs (with hooks, the backward's host time was
#   the limit), DTYPE (default bf16), BUCKET_MB (default 25,100), gradients communicated in COMM_DTYPE (default
#   grad,bf16), and with PROFILE set, bucketed 100 MB and torch DDP profiled;
# sharded: our FSDP, FSDP2 and ZeRO-1 (memory against parallelism_calc's prediction), eager, xl bf16 at 4 x 1,024
#   a rank (cuDNN attention) and at the issue's 2 x 512 (SDPA), each beside its one-GPU run; COMPILE=1 compiles
#   the blocks (the FSDPs' hooks eager around each); with PROFILE set, both FSDPs profiled at 4 x 1,024
#   (OUT_DIR/ddp_profiles.tar.xz);
# scaling: the step users run (xl, 4 x 1,024 per rank, bf16 autocast, cuDNN attention, compiled blocks) over all
#   GPUs against one: bucketed 100 MB and torch DDP with each region replayed as CUDA graphs, gradients in fp32
#   and bf16 (COMM_DTYPE), bucketed's NCCL kernels on COMM_SMS SMs (default 0: NCCL's choice), then our FSDP and
#   FSDP2 (compiled blocks, no graphs), each family beside its own one-GPU run;
# zero2: that step with each region's CUDA graphs and 100 MB buckets, ZeRO-2 (its weights gathered by NCCL, then by
#   the copy engines; ENGINE to choose) against bucketed DDP (both with bf16 gradients), first under bf16
#   autocast (fp32 weights), then with bf16 weights over fp32 masters (bf16_mixed: ZeRO-2 gathers 2 bytes a weight),
#   each dtype beside its one-GPU run; with PROFILE set, all profiled under bf16_mixed (OUT_DIR/ddp_profiles.tar.xz);
# engines: that step (DTYPE, default bf16) beside its one-GPU run: bucketed 100 MB with its all-reduce on NCCL and on
#   the copy engines (ENGINE), gradients in fp32 and bf16 (COMM_DTYPE), the optimizer stepping each bucket as it lands
#   (OPTIMIZER_STEP: overlapped, and/or after; bf16_mixed), the copy engines' means in each bucket and/or in the
#   optimizer (MEAN, default bucket; bucket,optimizer for both), then DIST (default torch_ddp; none: no other) beside
#   it; with PROFILE set, bucketed on the copy engines with bf16 gradients profiled (OUT_DIR/ddp_profiles.tar.xz);
# variants: issue 16's one call: the step users run at its fastest (xl, 4 x 1,024 per rank, bf16 weights over fp32
#   masters, cuDNN attention, compiled blocks with their CUDA graphs, 100 MB buckets) on one GPU, on GPU 0 and again
#   on GPU 1 (OUT_DIR/ddp_none_gpu1.jsonl: a synchronous step goes at its slower card's pace), then naive,
#   individual, bucketed (NCCL, and copy engines with the means in each bucket and in the optimizer) and torch DDP
#   over all GPUs; then our FSDP and FSDP2 under bf16
#   autocast (compiled blocks, no graphs) beside their one-GPU run;
# matrix: the training matrix (sdpa / naive / flash_triton x none / naive / bucketed / torch DDP, small, 5 epochs);
# accum: the batch x accumulation study (16x64 ... 1024x1, bucketed DDP, small at
#   128 tokens); leaderboard: the CS336 leaderboard's step (torch_impl.bench.leaderboard: lm8b, 2 x 32,768 global,
#   bf16, fused loss, checkpointing every block, our FSDP; DIST=fsdp2 for FSDP2, ATTENTION (default flash_triton),
#   LAYERS to profile a shallower model's memory, BATCH global sequences (2), AC_EVERY (1; 0: none), LOSS (fused),
#   COMPILE=1 for compiled blocks, KEEP_ATTENTION=1 to keep the attention outputs through the checkpoints, PROFILE=1
#   for one profiled step in OUT/profiles) on 2 GPUs, or NPROC of them;
# nodes: issue 23's several nodes on one host of 2 GPUs, one GPU a node (CUDA_VISIBLE_DEVICES): the trainer (small,
#   bf16, naive attention: deterministic kernels, bucketed DDP, a checkpoint an epoch) as one node of 2 processes, as
#   two torchrun nodes of 1 meeting at a c10d rendezvous, and under --max-restarts 1 with rank 1 killed in step 30
#   (TRAIN_FAULT_AT_STEP) resuming from its checkpoint (OUT_DIR/nodes_train.jsonl); the DDP benchmark (xl, bf16,
#   4 x 1,024 a rank, bucketed and our FSDP) as one node and as two (OUT_DIR/nodes_ddp.jsonl); the launchers' NCCL
#   transports in OUT_DIR/nodes_nccl.txt; then `python -m analysis.multihost` compares each launch with one node's;
# processes: issue 23's JAX one process a GPU (jax.distributed from torchrun's variables): the mesh e2e benchmark
#   (xl, bf16, 8 x 1,024 global, fsdp=2) and the JAX trainer (small, fsdp=2, XLA's deterministic kernels: without
#   them two runs' losses differed by up to 2e-3) as one process of 2 GPUs and as
#   `torchrun --nproc-per-node 2` (OUT_DIR/processes_e2e.jsonl, OUT_DIR/processes_train.jsonl), then compared.
# reshard: issue 23's DCP checkpoints on NCCL: our FSDP on 2 GPUs saved after epoch 1 and resumed on 1, saved on 1
#   and resumed on 2 as individual DDP, beside an uninterrupted run on 2 (OUT_DIR/reshard_train.jsonl, reshard.md);
# launch: the nodes phase's DDP benchmark (bucketed) launched five ways, to see whether the launch (threads, GPUs
#   visible) sets the step time (OUT_DIR/launch_ddp.jsonl, OUT_DIR/launch.md).
# snapshot: issue 16's memory rows: the eager step (bf16 autocast, cuDNN attention) of xl at 4 x 1,024 and of 2.7B at
#   4 x 512 a rank, on one GPU and as our FSDP, FSDP2 and bucketed DDP over all GPUs, each with one more step's CUDA
#   allocator history recorded on every rank (OUT_DIR/snapshots.tar.xz; `python -m analysis.snapshot` reads them).
# fidelity: our FSDP and FSDP2 at xl 4 x 1,024 a rank (compiled blocks) beside one GPU, each rank's step split
#   (compute, collectives, idle; analysis.overlap) in its record, and the processes study's JAX steps profiled:
#   the fidelity report's evidence.
set -uo pipefail
out=${1:?usage: scripts/gpu_distributed.sh OUT_DIR PHASE}
phases="allreduce, ddp, seed, overlap, graphs, sharded, scaling, zero2, engines, variants, matrix, accum, leaderboard,
  nodes, processes, reshard, launch, snapshot, fidelity"
phase=${2:?usage: scripts/gpu_distributed.sh OUT_DIR PHASE; phases: $phases}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
n=$(nvidia-smi -L | wc -l)
run=(torchrun --standalone --nproc_per_node)
pack() {  # pack DIR ARCHIVE: OUT_DIR/DIR -> OUT_DIR/ARCHIVE.tar.xz (traces a third smaller than gzipped)
  : "${1:?pack: a folder of OUT_DIR}" "${2:?pack: an archive name}"
  python3 -c $'import sys, tarfile\nwith tarfile.open(sys.argv[1], "w:xz") as t:\n    t.add(sys.argv[2], sys.argv[3])' \
    "$out/$2.tar.xz" "$out/$1" "$1" && rm -rf "${out:?}/$1"
}
pack_profiles() { pack profiles ddp_profiles; }
two_nodes() {  # two_nodes LOG_PREFIX ARGS...: two torchrun "nodes" of one GPU each side by side (c10d rendezvous;
  # it numbers the nodes as they arrive, so --node-rank orders the logs, not the ranks)
  local log=$1 port pids=() node
  shift
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
  for node in 0 1; do
    CUDA_VISIBLE_DEVICES=$node timeout 200 torchrun --nnodes 2 \
      --node-rank $node --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint "localhost:$port" --rdzv-id nodes \
      --rdzv-conf "is_host=$((node == 0))" "$@" > "$log$node.log" 2>&1 &
    pids+=($!)
  done
  for node in 0 1; do wait "${pids[$node]}"; echo "$log: node $node exit $?"; done
}
case "$phase" in
allreduce)
  for world in 2 4; do
    [[ $world -le $n ]] && "${run[@]}" "$world" -m torch_impl.bench.allreduce --backend nccl \
      --sizes 1MB,10MB,100MB,1GB --out "$out/allreduce_nccl.jsonl"
  done ;;
ddp)
  ddp=(-m torch_impl.bench.ddp --model xl --batch-size 2 --seq-len 512 --dtype bf16 --attention sdpa
       --bucket-mb 25 --out "$out/ddp.jsonl")
  python3 "${ddp[@]}" --dist none
  "${run[@]}" "$n" "${ddp[@]}" --dist naive,flat,individual,bucketed,torch_ddp ;;
overlap)
  ddp=(-m torch_impl.bench.ddp --model xl --batch-size 4 --seq-len 1024 --dtype bf16 --attention sdpa_cudnn
       --compile --out "$out/ddp.jsonl")
  python3 scripts/carveout_probe.py --sms 4,8,16,24 --out "$out/carveout.jsonl"
  python3 "${ddp[@]}" --dist none
  "${run[@]}" "$n" "${ddp[@]}" --dist naive,torch_ddp
  "${run[@]}" "$n" "${ddp[@]}" --dist individual,bucketed --bucket-mb 25 --comm-sms "${COMM_SMS:-0,4,8,16}"
  "${run[@]}" "$n" "${ddp[@]}" --dist bucketed --bucket-mb 25 --comm-sms "${PROFILE_SMS:-8}" \
    --profile "$out/profiles" --out "$out/ddp_profiled.jsonl"
  pack_profiles ;;
graphs)
  ddp=(-m torch_impl.bench.ddp --model xl --batch-size 4 --seq-len 1024 --dtype "${DTYPE:-bf16}"
       --attention sdpa_cudnn --compile --cuda-graph blocks --out "$out/ddp.jsonl")
  python3 "${ddp[@]}" --dist none
  "${run[@]}" "$n" "${ddp[@]}" --dist naive,individual,bucketed,torch_ddp --bucket-mb "${BUCKET_MB:-25,100}" \
    --comm-dtype "${COMM_DTYPE:-grad,bf16}"
  if [[ -n "${PROFILE:-}" ]]; then
    "${run[@]}" "$n" "${ddp[@]}" --dist bucketed,torch_ddp --bucket-mb 100 --profile "$out/profiles" \
      --out "$out/ddp_profiled.jsonl"
    pack_profiles
  fi ;;
seed)
  ddp=(-m torch_impl.bench.ddp --model xl --batch-size 2 --seq-len 512 --dtype fp32 --attention sdpa
       --out "$out/ddp.jsonl")
  python3 "${ddp[@]}" --dist none
  "${run[@]}" "$n" "${ddp[@]}" --dist naive,individual,bucketed,torch_ddp --bucket-mb 25 ;;
sharded)
  for config in "4 1024 sdpa_cudnn" "2 512 sdpa"; do
    read -r batch seq attention <<< "$config"
    ddp=(-m torch_impl.bench.ddp --model xl --batch-size "$batch" --seq-len "$seq" --dtype bf16
         --attention "$attention" ${COMPILE:+--compile} --out "$out/ddp.jsonl")
    python3 "${ddp[@]}" --dist none
    "${run[@]}" "$n" "${ddp[@]}" --dist fsdp,fsdp2,zero1 --bucket-mb 25
  done
  if [[ -n "${PROFILE:-}" ]]; then
    "${run[@]}" "$n" -m torch_impl.bench.ddp --model xl --batch-size 4 --seq-len 1024 --dtype bf16 \
      --attention sdpa_cudnn ${COMPILE:+--compile} --dist fsdp,fsdp2 --profile "$out/profiles" \
      --out "$out/ddp_profiled.jsonl"
    pack_profiles
  fi ;;
scaling)
  ddp=(-m torch_impl.bench.ddp --model xl --batch-size 4 --seq-len 1024 --dtype bf16 --attention sdpa_cudnn
       --compile --out "$out/ddp.jsonl")
  python3 "${ddp[@]}" --dist none --cuda-graph blocks
  "${run[@]}" "$n" "${ddp[@]}" --dist bucketed,torch_ddp --bucket-mb 100 --comm-dtype "${COMM_DTYPE:-grad,bf16}" \
    --comm-sms "${COMM_SMS:-0}" --cuda-graph blocks
  python3 "${ddp[@]}" --dist none
  "${run[@]}" "$n" "${ddp[@]}" --dist fsdp,fsdp2 ;;
zero2)
  ddp=(-m torch_impl.bench.ddp --model xl --batch-size 4 --seq-len 1024 --attention sdpa_cudnn --compile
       --cuda-graph blocks --bucket-mb 100 --out "$out/ddp.jsonl")
  for dtype in bf16 bf16_mixed; do
    python3 "${ddp[@]}" --dtype "$dtype" --dist none
    "${run[@]}" "$n" "${ddp[@]}" --dtype "$dtype" --dist bucketed,zero2 --comm-dtype bf16 \
      --engine "${ENGINE:-nccl,copy_engines}"
  done
  if [[ -n "${PROFILE:-}" ]]; then
    "${run[@]}" "$n" "${ddp[@]}" --dtype bf16_mixed --dist bucketed,zero2 --comm-dtype bf16 \
      --engine "${ENGINE:-nccl,copy_engines}" --profile "$out/profiles" --out "$out/ddp_profiled.jsonl"
    pack_profiles
  fi ;;
engines)
  ddp=(-m torch_impl.bench.ddp --model xl --batch-size 4 --seq-len 1024 --dtype "${DTYPE:-bf16}"
       --attention sdpa_cudnn --compile --cuda-graph blocks --bucket-mb 100 --out "$out/ddp.jsonl")
  python3 "${ddp[@]}" --dist none
  "${run[@]}" "$n" "${ddp[@]}" --dist bucketed --comm-dtype "${COMM_DTYPE:-grad,bf16}" \
    --engine "${ENGINE:-nccl,copy_engines}" --optimizer-step "${OPTIMIZER_STEP:-overlapped}" --mean "${MEAN:-bucket}"
  [[ "${DIST:-torch_ddp}" != none ]] && "${run[@]}" "$n" "${ddp[@]}" --dist "${DIST:-torch_ddp}" \
    --comm-dtype "${COMM_DTYPE:-grad,bf16}"
  if [[ -n "${PROFILE:-}" ]]; then
    "${run[@]}" "$n" "${ddp[@]}" --dist bucketed --comm-dtype bf16 --engine copy_engines --profile "$out/profiles" \
      --out "$out/ddp_profiled.jsonl"
    pack_profiles
  fi ;;
variants)
  ddp=(-m torch_impl.bench.ddp --model xl --batch-size 4 --seq-len 1024 --attention sdpa_cudnn --compile
       --bucket-mb 100 --out "$out/ddp.jsonl")
  mixed=("${ddp[@]}" --dtype bf16_mixed --cuda-graph blocks)
  python3 "${mixed[@]}" --dist none
  CUDA_VISIBLE_DEVICES=1 python3 "${mixed[@]}" --dist none --out "$out/ddp_none_gpu1.jsonl"
  "${run[@]}" "$n" "${mixed[@]}" --dist naive,individual,bucketed,torch_ddp --engine nccl,copy_engines \
    --mean bucket,optimizer
  python3 "${ddp[@]}" --dtype bf16 --dist none
  "${run[@]}" "$n" "${ddp[@]}" --dtype bf16 --dist fsdp,fsdp2 ;;
matrix)
  python3 -m torch_impl.bench.train_matrix --nproc "$n" --model small --batch-size 8 --seq-len 512 --epochs 5 \
    --steps-per-epoch 40 --out "$out/train_matrix.jsonl" --report-dir "$out/train_matrix" ;;
accum)
  python3 -m torch_impl.bench.accum_study --nproc "$n" --model small --seq-len 128 --epochs 2 --steps-per-epoch 5 \
    --dist bucketed --out "$out/accum_study.jsonl" --report-dir "$out/accum_study" ;;
leaderboard)
  ac=${AC_EVERY:-1}
  "${run[@]}" "${NPROC:-2}" -m torch_impl.bench.leaderboard --model lm8b --batch-size "${BATCH:-2}" --seq-len 32768 \
    --dtype bf16 --loss "${LOSS:-fused}" $([[ $ac != 0 ]] && echo --ac-every "$ac") --dist "${DIST:-fsdp}" \
    --attention "${ATTENTION:-flash_triton}" ${LAYERS:+--layers "$LAYERS"} ${COMPILE:+--compile} \
    ${KEEP_ATTENTION:+--keep-attention} ${PROFILE:+--profile "$out/profiles"} --out "$out/leaderboard.jsonl" ;;
nodes)
  [[ $n -ge 2 ]] || { echo "nodes: needs 2 GPUs, this machine has $n" >&2; exit 1; }
  train=(-m torch_impl.train --model small --seq-len 512 --batch-size 8 --epochs 3 --steps-per-epoch 20 --val-batches 4
         --dtype bf16 --attention naive --dist bucketed --timeout 120 --no-progress --auto-resume
         --out "$out/nodes_train.jsonl")
  ddp=(-m torch_impl.bench.ddp --model xl --batch-size 4 --seq-len 1024 --dtype bf16 --attention sdpa_cudnn
       --bucket-mb 100 --dist bucketed,fsdp --timeout 120 --out "$out/nodes_ddp.jsonl")
  ckpt=$(mktemp -d)
  export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT  # the transports NCCL picked, into the launchers' logs
  timeout 150 "${run[@]}" 2 "${train[@]}" --run-name one_node --checkpoint-dir "$ckpt/one" \
    > "$out/nodes_one.log" 2>&1; echo "one node: exit $?"
  two_nodes "$out/nodes_two" "${train[@]}" --run-name two_nodes --checkpoint-dir "$ckpt/two"
  TRAIN_FAULT_AT_STEP=1:30 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 timeout 200 "${run[@]}" 2 --max-restarts 1 \
    "${train[@]}" --run-name elastic --checkpoint-dir "$ckpt/elastic" > "$out/nodes_elastic.log" 2>&1
  echo "killed rank, --max-restarts 1: exit $?"
  rm -rf "$ckpt"
  timeout 200 "${run[@]}" 2 "${ddp[@]}" > "$out/nodes_ddp_one.log" 2>&1; echo "ddp, one node: exit $?"
  two_nodes "$out/nodes_ddp_two" "${ddp[@]}"
  for log in "$out"/nodes_*.log; do  # how each launch's ranks were connected: NCCL's transports, counted
    echo "$(basename "$log"): $(grep -o ' via [A-Za-z0-9/_]*' "$log" | sort | uniq -c | tr -s ' \n' ' ')"
  done > "$out/nodes_nccl.txt"
  python3 -m analysis.multihost "$out/nodes_train.jsonl" "$out/nodes_ddp.jsonl" --out "$out/nodes.md" ;;
fidelity)
  # The FSDP steps the fidelity report had no profile of (analysis.fidelity.explain_kernels): our FSDP and FSDP2 at
  # xl 4 x 1,024 a rank (bf16 autocast, cuDNN attention, compiled blocks) over all GPUs beside one GPU, profiled:
  # each rank's compute, collectives and idle time a step in the records (per_rank_profile_ms; the traces dropped),
  # the GPU's kernels alone (--profile-host off: with the host's ops recorded too, the profiled steps ran 1.3-1.6x
  # the timed ones at e3c301a).
  # FIDELITY_PART=ddp or jax runs one part (default both).
  [[ $n -ge 2 ]] || { echo "fidelity: needs 2 GPUs, this machine has $n" >&2; exit 1; }
  [[ "${FIDELITY_PART:-ddp}" =~ ^(ddp|jax)$ ]] || { echo "FIDELITY_PART=$FIDELITY_PART: ddp or jax" >&2; exit 2; }
  if [[ "${FIDELITY_PART:-ddp}" == ddp ]]; then
    ddp=(-m torch_impl.bench.ddp --model xl --batch-size 4 --seq-len 1024 --dtype bf16 --attention sdpa_cudnn
         --compile --out "$out/ddp_fidelity.jsonl")
    timeout 200 python3 "${ddp[@]}" --dist none
    timeout 300 "${run[@]}" "$n" "${ddp[@]}" --dist fsdp,fsdp2 --profile "$out/profiles" --profile-host off
    rm -rf "$out/profiles"
  fi
  # The JAX steps of the processes study (xl, FSDP over 2 GPUs, one process and one per GPU) and of its trainer
  # (small, naive attention), profiled: one device's kernel time by category and idle time in the records.
  if [[ "${FIDELITY_PART:-jax}" == jax ]]; then
    export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
    jax=(-m jax_impl.bench.e2e --dtype bf16 --mesh fsdp=2 --warmup 5 --steps 20 --suite jax_fidelity
         --out "$out/jax_fidelity.jsonl" --profile "$out/jax_profile")
    timeout 200 python3 "${jax[@]}" --model xl --batch-size 8 --seq-len 1024 --attention dot_product_cudnn
    timeout 200 "${run[@]}" 2 "${jax[@]}" --model xl --batch-size 8 --seq-len 1024 --attention dot_product_cudnn
    timeout 200 python3 "${jax[@]}" --model small --batch-size 16 --seq-len 512 --attention naive
    rm -rf "$out/jax_profile"
  fi ;;
processes)
  [[ $n -ge 2 ]] || { echo "processes: needs 2 GPUs, this machine has $n" >&2; exit 1; }
  export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
  e2e=(-m jax_impl.bench.e2e --model xl --batch-size 8 --seq-len 1024 --dtype bf16 --mesh fsdp=2
       --attention dot_product_cudnn --warmup 5 --steps 20 --suite processes --out "$out/processes_e2e.jsonl")
  train=(-m jax_impl.trainer --model small --seq-len 512 --batch-size 16 --epochs 2 --steps-per-epoch 20
         --val-batches 4 --dtype bf16 --mesh fsdp=2 --no-progress --out "$out/processes_train.jsonl")
  one_process=(python3) two_processes=("${run[@]}" 2)  # one process of both GPUs; torchrun's one process a GPU
  for name in one_process two_processes; do
    declare -n cmd=$name
    timeout 200 "${cmd[@]}" "${e2e[@]}" > "$out/processes_e2e_$name.log" 2>&1; echo "e2e, $name: exit $?"
    XLA_FLAGS="--xla_gpu_deterministic_ops=true ${XLA_FLAGS:-}" timeout 150 "${cmd[@]}" "${train[@]}" \
      --run-name "$name" > "$out/processes_train_$name.log" 2>&1
    echo "trainer, $name: exit $?"
  done
  python3 -m analysis.multihost "$out/processes_e2e.jsonl" "$out/processes_train.jsonl" --out "$out/processes.md" ;;
reshard)
  [[ $n -ge 2 ]] || { echo "reshard: needs 2 GPUs, this machine has $n" >&2; exit 1; }
  # DCP checkpoints across world sizes on NCCL: our FSDP (small, fp32, naive attention) uninterrupted on 2 GPUs,
  # then saved on 2 after epoch 1 and resumed on 1 GPU (the same global batch: 2 micro-batches a step), and saved
  # on 1 and resumed on 2 as individual DDP
  train=(-m torch_impl.train --model small --seq-len 512 --epochs 2 --steps-per-epoch 20 --val-batches 4 --dtype fp32
         --attention naive --timeout 120 --no-progress --out "$out/reshard_train.jsonl")
  ckpt=$(mktemp -d)
  timeout 300 "${run[@]}" 2 "${train[@]}" --dist fsdp --batch-size 8 --run-name fsdp_on_2; echo "uninterrupted: exit $?"
  timeout 300 "${run[@]}" 2 "${train[@]}" --dist fsdp --batch-size 8 --run-name saved_on_2 --checkpoint-dir "$ckpt/a" \
    --stop-after-epochs 1; echo "saved on 2: exit $?"
  timeout 300 "${run[@]}" 1 "${train[@]}" --dist fsdp --batch-size 8 --grad-accum 2 --run-name resumed_on_1 \
    --checkpoint-dir "$ckpt/a" --resume; echo "resumed on 1: exit $?"
  timeout 300 "${run[@]}" 1 "${train[@]}" --dist fsdp --batch-size 8 --grad-accum 2 --run-name saved_on_1 \
    --checkpoint-dir "$ckpt/b" --stop-after-epochs 1; echo "saved on 1: exit $?"
  timeout 300 "${run[@]}" 2 "${train[@]}" --dist individual --batch-size 8 --run-name resumed_on_2_individual \
    --checkpoint-dir "$ckpt/b" --resume; echo "resumed on 2: exit $?"
  rm -rf "$ckpt"
  python3 -m analysis.reports table "$out/reshard_train.jsonl" --columns implementation,world_size,batch_size \
    --metrics run,epoch,train_loss,val_loss --out "$out/reshard.md" ;;
launch)
  [[ $n -ge 2 ]] || { echo "launch: needs 2 GPUs, this machine has $n" >&2; exit 1; }
  # Do one-node launches step slower than two-node ones (the nodes phase's first call read so; notes/multihost.md:
  # no, the same launch's spread is larger)? The DDP benchmark as there, launched as one node (torchrun sets
  # OMP_NUM_THREADS=1 for several processes a node), one node with OMP_NUM_THREADS=16, one node with each rank
  # seeing only its GPU, two nodes (one GPU and all threads each), then one node again.
  ddp=(-m torch_impl.bench.ddp --model xl --batch-size 4 --seq-len 1024 --dtype bf16 --attention sdpa_cudnn
       --bucket-mb 100 --dist bucketed --timeout 120 --out "$out/launch_ddp.jsonl")
  own_gpu=(--no-python bash -c 'CUDA_VISIBLE_DEVICES=$LOCAL_RANK exec python3 "$@"' own_gpu)
  timeout 200 "${run[@]}" 2 "${ddp[@]}"; echo "one node: exit $?"
  OMP_NUM_THREADS=16 timeout 200 "${run[@]}" 2 "${ddp[@]}"; echo "one node, 16 threads: exit $?"
  timeout 200 "${run[@]}" 2 "${own_gpu[@]}" "${ddp[@]}"; echo "one node, a GPU a rank: exit $?"
  two_nodes "$out/launch_two" "${ddp[@]}"
  timeout 200 "${run[@]}" 2 "${ddp[@]}"; echo "one node again: exit $?"
  python3 -m analysis.multihost "$out/launch_ddp.jsonl" --out "$out/launch.md" ;;
snapshot)
  for config in "xl 4 1024" "2.7B 4 512"; do
    read -r model batch seq <<< "$config"
    ddp=(-m torch_impl.bench.ddp --model "$model" --batch-size "$batch" --seq-len "$seq" --dtype bf16
         --attention sdpa_cudnn --memory-snapshot "$out/snapshots/${model}_${batch}x$seq" --out "$out/ddp.jsonl")
    timeout 150 python3 "${ddp[@]}" --dist none
    timeout 200 "${run[@]}" "$n" "${ddp[@]}" --dist fsdp,fsdp2,bucketed --bucket-mb 25
  done
  pack snapshots snapshots ;;
*) echo "unknown phase $phase; accepted: $phases" >&2
   exit 2 ;;
esac
python3 -m analysis.reports "$out" --out "$out/reports"

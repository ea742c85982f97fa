"""Do ZeRO-2's collectives slow the GEMMs beside them less when copy engines move the bytes? xl's backward GEMMs in
a loop on the compute stream, alone and beside each way of moving a run of buckets on a side stream: NCCL's
all-gather and reduce-scatter (kernels that hold SMs), and copies to or from the peer's symmetric-memory buffer
(``copy_`` of contiguous tensors is a ``cudaMemcpyAsync``: copy engines, no SMs), the reduce-scatter's sum then an
elementwise add. Two ranks, one GPU each; timing only (the copies are not ordered against the peer's writes).

    torchrun --standalone --nproc_per_node 2 scripts/ce_probe.py [--bucket-mb 50] [--buckets 24] [--out FILE.jsonl]

A persistent cuBLAS GEMM launches one CTA per SM, so beside an NCCL kernel its last CTAs wait for a second wave
(notes/data_parallel.md, finding 1); copy engines would leave every SM to the GEMMs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

SHAPES = ((4096, 1600, 6400), (4096, 6400, 1600), (1600, 4096, 6400))  # (M, K, N): xl's backward at 4 x 1,024
MODES = ("nccl_all_gather", "nccl_reduce_scatter", "ce_push", "ce_pull_add")


def _timed(stream: torch.cuda.Stream, work) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        work()
        end.record()
    return start, end


class Probe:
    def __init__(self, rank: int, bucket_mb: float, buckets: int, gemm_reps: int):
        self.rank, self.peer, self.device = rank, 1 - rank, torch.device("cuda", rank)
        self.compute, self.side = torch.cuda.current_stream(), torch.cuda.Stream()
        half = int(bucket_mb * 2**20 / 2 / 2)  # bf16 elements this rank sends per bucket (N = 2: half a bucket)
        self.mine = [torch.randn(half, device=self.device, dtype=torch.bfloat16) for _ in range(buckets)]
        self.full = [torch.empty(2 * half, device=self.device, dtype=torch.bfloat16) for _ in range(buckets)]
        self.mats = [(torch.randn(m, k, device=self.device, dtype=torch.bfloat16),
                      torch.randn(k, n, device=self.device, dtype=torch.bfloat16)) for m, k, n in SHAPES]
        self.gemm_reps, self.buckets = gemm_reps, buckets
        self.peer_bufs, self.symm_error = None, None
        try:  # one symmetric buffer a bucket: what this rank receives; the peer writes into it (push) or reads (pull)
            import torch.distributed._symmetric_memory as symm_mem

            store = symm_mem.empty(buckets * half, dtype=torch.bfloat16, device=self.device)
            handle = symm_mem.rendezvous(store, dist.group.WORLD.group_name)
            peer = handle.get_buffer(self.peer, (buckets * half,), torch.bfloat16)
            self.local_bufs = list(store.split(half))
            self.peer_bufs = list(peer.split(half))
        except Exception as e:  # noqa: BLE001 - recorded: the sandbox may refuse the handle exchange
            self.symm_error = f"{type(e).__name__}: {e}"[:300]

    def gemms(self) -> None:
        for _ in range(self.gemm_reps):
            for a, b in self.mats:
                a @ b

    def comm(self, mode: str) -> None:
        for k in range(self.buckets):
            if mode == "nccl_all_gather":
                dist.all_gather_into_tensor(self.full[k], self.mine[k])
            elif mode == "nccl_reduce_scatter":
                dist.reduce_scatter_tensor(self.mine[k], self.full[k])
            elif mode == "ce_push":  # this rank's half into the peer's buffer: the all-gather's bytes
                self.peer_bufs[k].copy_(self.mine[k])
            else:  # the peer's half of this rank's slice, read over NVLink, then summed here: the reduce-scatter's
                self.local_bufs[k].copy_(self.peer_bufs[k])
                self.mine[k].add_(self.local_bufs[k])

    def trial(self, mode: str | None, with_gemms: bool) -> tuple[float | None, float | None]:
        """(GEMM loop ms, comm ms), the two launched together on their streams."""
        dist.barrier()
        torch.cuda.synchronize()
        self.side.wait_stream(self.compute)
        comm = _timed(self.side, lambda: self.comm(mode)) if mode else None
        gemm = _timed(self.compute, self.gemms) if with_gemms else None
        torch.cuda.synchronize()
        return (gemm[0].elapsed_time(gemm[1]) if gemm else None, comm[0].elapsed_time(comm[1]) if comm else None)

    def kinds(self, mode: str) -> list[str]:
        """The names of the GPU activities one run of the mode leaves in a profile (a memcpy: copy engines)."""
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            self.trial(mode, with_gemms=False)
        names = {e.name[:60] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
        return sorted(names)[:8]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bucket-mb", type=float, default=50.0, help="bytes of a bucket in MiB, bf16 (default 50)")
    parser.add_argument("--buckets", type=int, default=24, help="buckets moved in a run (default 24)")
    parser.add_argument("--gemm-reps", type=int, default=30, help="rounds of the three GEMMs in a loop (default 30)")
    parser.add_argument("--trials", type=int, default=5, help="timed trials per measurement, median (default 5)")
    parser.add_argument("--out", help="append one JSON line per mode here (rank 0)")
    args = parser.parse_args(argv)
    if "RANK" not in os.environ or not torch.cuda.is_available():
        print("ce_probe: run it under torchrun with 2 processes on 2 GPUs", file=sys.stderr)
        return 2
    if os.environ.get("WORLD_SIZE") != "2":
        print("ce_probe: --nproc_per_node 2 (the peer copies pair two ranks)", file=sys.stderr)
        return 2
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    probe = Probe(rank, args.bucket_mb, args.buckets, args.gemm_reps)

    def median(mode, with_gemms):
        probe.trial(mode, with_gemms)  # warm-up
        runs = [probe.trial(mode, with_gemms) for _ in range(args.trials)]
        return tuple(statistics.median(r[i] for r in runs) if runs[0][i] is not None else None for i in (0, 1))

    alone, _ = median(None, True)
    for mode in MODES:
        row = {"mode": mode, "bucket_mb": args.bucket_mb, "buckets": args.buckets, "rank": rank,
               "device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "git_commit": os.environ.get("RESULTS_GIT_COMMIT"), "gemm_alone_ms": alone}
        if mode.startswith("ce") and probe.peer_bufs is None:
            row["error"] = probe.symm_error
        else:
            _, row["comm_alone_ms"] = median(mode, False)
            row["gemm_beside_ms"], row["comm_beside_ms"] = median(mode, True)
            row["gemm_extra_ms"] = row["gemm_beside_ms"] - alone  # what the comm cost the GEMMs beside it
            row["gpu_activities"] = probe.kinds(mode)
        print(json.dumps(row), flush=True)
        if args.out and rank == 0:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Does cuBLAS leave SMs free when asked? The xl backward's matrix products under each BLAS library, with and
without ``torch_impl.distributed.ddp.leave_sms_to_communication``: kernel, grid (CTAs) and median time, one GPU.

    PYTHONPATH=. python3 scripts/carveout_probe.py [--sms 8,24] [--out FILE.jsonl]

A persistent GEMM launches one CTA per SM; next to an NCCL kernel holding k SMs it runs in two waves
(notes/data_parallel.md). With the carveout its grid should shrink to the SMs left (132 - k on an H100).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from torch_impl.distributed.ddp import leave_sms_to_communication, restore_matmul_sms

# (M, K, N) of xl's backward at 4 x 1,024 tokens: d_model 1,600, d_ff 6,400
SHAPES = ((4096, 1600, 6400), (4096, 6400, 1600), (1600, 4096, 6400))


def measure(m: int, k: int, n: int, reps: int = 20) -> dict:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            a @ b
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memset", "Memcpy"))]  # cuBLASLt clears its workspace: not the GEMM
    durations = [e.device_time for e in kernels]
    return {"kernel": kernels[0].name[:80] if kernels else None, "median_us": statistics.median(durations),
            "grid": _grids(prof)}


def _grids(prof) -> list:
    """The launch grids the trace recorded (profiler events carry no grid; the Chrome trace does)."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "t.json")
        prof.export_chrome_trace(path)
        events = json.load(open(path))["traceEvents"]
    return sorted({str(e["args"].get("grid")) for e in events if e.get("cat") == "kernel"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sms", default="8,24", help="SMs to leave free, comma list (default 8,24)")
    parser.add_argument("--out", help="append one JSON line per measurement here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    sms = [int(s) for s in args.sms.split(",")]
    rows = []
    for shape in SHAPES:
        base = {"shape": shape, "leave_sms": 0, "library": "default (cublas)", **measure(*shape)}
        rows.append(base)
        for k in sms:
            replaced = leave_sms_to_communication(k)
            try:
                rows.append({"shape": shape, "leave_sms": k, "library": "cublaslt", **measure(*shape)})
            finally:
                restore_matmul_sms(replaced)
    for row in rows:
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

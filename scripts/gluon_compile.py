"""Compile the Gluon FlashAttention kernels for sm_90 on a machine without a GPU, and read what ptxas says of them.

    python scripts/gluon_compile.py            # the backward, every configuration of CONFIGS x OPTIONS
    python scripts/gluon_compile.py --check    # exit 1 if ptxas serializes a wgmma or spills in an MMA loop
    python scripts/gluon_compile.py --check --first   # what the op runs: the defaults of both (CI)
    python scripts/gluon_compile.py --sass OUT_DIR   # also write each kernel's SASS

Triton compiles for a target it is told, not one it finds, so a stand-in driver names an H100 (sm_90, warp 32) and
``JITFunction.warmup`` compiles without launching; the PTX then goes through the ptxas bundled with Triton with
``-v``. That report is where the forward's worst slowdown showed (ptxas warning C7514: every wgmma serialized
because a loop-carried value of an unfinished wgmma was copied; notes/flash_attention.md, session 18) and it costs
no device time: check a kernel change here before a GPU call. Per configuration it prints registers, spilled bytes,
ptxas's performance warnings and the count of the SASS instructions the softmax and the MMAs run on.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

from torch_impl.attention import flash_gluon

TARGET = GPUTarget("cuda", 90, 32)
PADDED_HEAD_DIM = 80  # a head dim below its tile (the 2.7B preset's), compiled beside the tiles' own without --first
WATCHED = ("HGMMA", "MUFU", "FFMA", "FMUL", "FADD", "FMNMX", "F2FP")  # the MMAs and the softmax's arithmetic


class _TargetOnly:
    """The driver methods ``warmup`` asks for, answering for an sm_90 device that is not there."""

    def get_current_target(self):
        return TARGET

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def is_active(self):
        return True

    def map_python_to_cpp_type(self, ty):
        return ty


def _tool(name: str) -> Path:
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name


def ptxas_report(ptx: str) -> str:
    """``ptxas -v`` for sm_90a on the PTX, with the first bundled ptxas that reads its PTX version."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        for name in ("ptxas", "ptxas-blackwell"):  # Triton 3.9 writes PTX newer than its plain ptxas reads
            if not _tool(name).exists():
                continue
            run = subprocess.run([str(_tool(name)), "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
                                 capture_output=True, text=True)
            if run.returncode == 0:
                return run.stdout + run.stderr
        raise RuntimeError(f"no bundled ptxas assembled the PTX: {run.stderr.strip()[-300:]}")


def sass(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(_tool("cuobjdump")), "-sass", f.name], capture_output=True, text=True).stdout


_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)([^;]*);")


# Spill loads the MMA loops may hold, as a share of their instructions (``spills_in_mma_loops``): each is an issue
# slot and an L1 hit. The d 128 backward, 1.2-1.8x the Triton backward on the H100 (Triton 3.6: 1 reload in 1,127
# instructions with DQ_LAG and three stages), has 22 in 1,244 with Triton 3.9 (scalars spilled at the program's
# start: ids, strides).
RELOAD_SHARE = 0.02


def spills_in_mma_loops(code: str) -> tuple[int, int, int]:
    """Spill stores and loads (STL, LDL) inside the innermost loops that run wgmma (HGMMA), the per-tile loops, and
    the loops' instructions. A store there means the loop's own values do not fit in registers; a load may be the
    reload of a value spilled once at the start, which costs little while they are few (RELOAD_SHARE). A loop is a
    branch back to a lower address with no EXIT between (which leaves out the jumps back from the out-of-line retries
    of the mbarrier waits, placed after the code); spills at a program's or a head's start are not counted (they
    run once; ptxas's byte count has them)."""
    ops = [(int(m.group(1), 16), m.group(2).split(".")[0], m.group(3)) for m in _INSTRUCTION.finditer(code)]
    loops = []
    for addr, op, rest in ops:
        target = re.match(r"\s*(0x[0-9a-f]+)", rest) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            lo = int(target.group(1), 16)
            if not any(lo <= a <= addr and o == "EXIT" for a, o, _ in ops):
                loops.append((lo, addr))
    mma = [(lo, hi) for lo, hi in loops if any(lo <= a <= hi and op == "HGMMA" for a, op, _ in ops)]
    innermost = [(lo, hi) for lo, hi in mma
                 if not any((lo, hi) != (l2, h2) and lo <= l2 and h2 <= hi for l2, h2 in mma)]
    inside = [op for a, op, _ in ops if any(lo <= a <= hi for lo, hi in innermost)]
    return inside.count("STL"), inside.count("LDL"), len(inside)


@contextlib.contextmanager
def _side_by_side(on: bool):
    """``flash_gluon.SIDE_BY_SIDE_3D`` set to ``on`` while launch arguments are made, as it was afterwards."""
    before, flash_gluon.SIDE_BY_SIDE_3D = flash_gluon.SIDE_BY_SIDE_3D, on
    try:
        yield
    finally:
        flash_gluon.SIDE_BY_SIDE_3D = before


def _heads(batch: int, heads: int, d: int, side_by_side: bool) -> torch.Tensor:
    """(B, H, 1024, d) bf16 on the CPU: contiguous, or (side_by_side) the model's (B, n, H, d) layout."""
    if side_by_side:
        return torch.empty(batch, 1024, heads, d, dtype=torch.bfloat16).transpose(1, 2)
    return torch.empty(batch, heads, 1024, d, dtype=torch.bfloat16)


def compile_config(d: int, config, is_causal: bool = True, programs: int | None = None, side_by_side: bool = False,
                   **options):
    """The compiled kernel of one configuration (CPU tensors stand in for the inputs; nothing is launched);
    ``programs``: a persistent grid of that many (None: a program per work item, the default); ``side_by_side``:
    q, k, v in the model's layout, 3-D views below the tile (``flash_gluon.SIDE_BY_SIDE_3D``)."""
    q = _heads(1, 2, d, side_by_side)
    with _side_by_side(side_by_side):
        grid, args, constexprs, _ = flash_gluon.launch_arguments(q, q, q, is_causal, config, programs=programs,
                                                                 **options)
    return flash_gluon._fwd_kernel.warmup(*args, grid=grid, **constexprs)


def compile_backward(d: int, is_causal: bool = True, programs: int | None = None, dq_lag: bool | None = None,
                     side_by_side: bool = False, order: str = "heads", rope: bool = False):
    """The compiled backward (two query heads a k/v head; dO and O contiguous), as ``compile_config`` compiles the
    forward; ``rope``: dK rotated back in its epilogue (the op's, on the model's q, k, v product)."""
    q, k, do = _heads(1, 4, d, side_by_side), _heads(1, 2, d, side_by_side), _heads(1, 4, d, False)
    tables = (torch.empty(1024, d // 2), torch.empty(1024, d // 2)) if rope else None
    with _side_by_side(side_by_side):
        kernel, grid, args, constexprs, _ = flash_gluon.backward_launch_arguments(
            do, q, k, k, do, torch.empty(1, 4, 1024), is_causal, programs=programs, dq_lag=dq_lag, order=order,
            rope=tables)
    return kernel.warmup(*args, grid=grid, **constexprs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if a wgmma is serialized or registers spill inside the MMA loops")
    parser.add_argument("--first", action="store_true",
                        help="only what the op runs: the forward's CONFIGS[d][0], the backward at BWD_MIN_KEYS' d")
    parser.add_argument("--sass", type=Path, metavar="DIR", help="write each kernel's SASS into DIR")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns while the default is unset
    driver.set_active(_TargetOnly())
    failures = []
    kernels = []
    for d in (*flash_gluon.BWD_MIN_KEYS, *([] if args.first else [PADDED_HEAD_DIM])):  # the backward's tile widths
        # the grid's default (``backward_launch_arguments``), and each choice of DQ_LAG where the kernel has it
        for lag in (None,) if args.first or flash_gluon._bwd_wide(d) else (False, True):
            name = f"backward_d{d}{'' if lag is None else '_dq_lag' if lag else '_no_dq_lag'}"
            kernels.append((name, functools.partial(compile_backward, d, dq_lag=lag)))
            if not flash_gluon._epilogue_in_stages(d):  # the persistent grid, in each order
                for order in flash_gluon.BWD_ORDERS:
                    kernels.append((f"{name}_persistent_{order}",
                                    functools.partial(compile_backward, d, programs=132, dq_lag=lag, order=order)))
        if not flash_gluon._bwd_wide(d):  # the op's on the model's product: dK rotated back in the epilogue
            kernels.append((f"backward_d{d}_rope", functools.partial(compile_backward, d, rope=True)))
            if not flash_gluon._epilogue_in_stages(d):
                kernels.append((f"backward_d{d}_rope_persistent_dynamic",
                                functools.partial(compile_backward, d, programs=132, order="dynamic", rope=True)))
    if not args.first:  # the model's (B, n, H, d) heads below the tile: 3-D views (flash_gluon.SIDE_BY_SIDE_3D)
        kernels.append((f"backward_d{PADDED_HEAD_DIM}_side_by_side",
                        functools.partial(compile_backward, PADDED_HEAD_DIM, side_by_side=True)))
        kernels.append((f"d{PADDED_HEAD_DIM}_side_by_side_persistent_dynamic",
                        functools.partial(compile_config, PADDED_HEAD_DIM, flash_gluon.CONFIGS[128][0], programs=132,
                                          order="dynamic", tma_store=True, side_by_side=True)))
    for d in flash_gluon.CONFIGS if args.first else (*flash_gluon.CONFIGS, PADDED_HEAD_DIM):
        for config in flash_gluon.CONFIGS[flash_gluon.tile_dim(d)][:1 if args.first else None]:
            for option, options in flash_gluon.OPTIONS.items():
                if not flash_gluon.runs_with(options, config, d, True):
                    continue
                kernels.append((f"d{d}_{'_'.join(map(str, config))}{'_' + option if option else ''}",
                                functools.partial(compile_config, d, config, **options)))
            for order in flash_gluon.ORDERS:  # the persistent grid in each order (the op's: O by TMA, folded)
                kernels.append((f"d{d}_{'_'.join(map(str, config))}_persistent_{order}",
                                functools.partial(compile_config, d, config, programs=132, order=order,
                                                  tma_store=order != "blocks"  # where O's tiles fit
                                                  and flash_gluon.tile_dim(d) in flash_gluon.TMA_STORE_TILE_DIMS,
                                                  folded=order != "blocks" and d in flash_gluon.FOLDED_HEAD_DIMS)))
    for name, build in kernels:
        kernel = build()
        report = ptxas_report(kernel.asm["ptx"])
        registers = re.search(r"Used (\d+) registers", report)
        spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
        warnings = [line.split(":", 1)[-1].strip() for line in report.splitlines() if "Performance Loss" in line]
        code = sass(kernel.asm["cubin"])
        ops = collections.Counter(m.group(2).split(".")[0] for m in _INSTRUCTION.finditer(code))
        stores, loads, in_loops = spills_in_mma_loops(code)
        print(f"{name}: {registers.group(1) if registers else '?'} registers at entry, {sum(spills)} bytes "
              f"spilled (in the MMA loops' {in_loops} instructions: {stores} stores, {loads} loads), shared "
              f"{kernel.metadata.shared} B; " +
              " ".join(f"{op} {ops[op]}" for op in WATCHED), flush=True)
        for warning in warnings:
            print(f"  ptxas: {warning}")
        if args.sass:
            args.sass.mkdir(parents=True, exist_ok=True)
            (args.sass / f"{name}.sass").write_text(code)
        if warnings or stores or loads > RELOAD_SHARE * in_loops or not ops["HGMMA"]:
            failures.append(name)
    if args.check and failures:
        print(f"gluon_compile: serialized wgmma, spills in an MMA loop or no wgmma in {', '.join(failures)}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The devices a JAX command line asks for: ``--device auto | cpu | cuda`` (``cuda:N`` for one), refused when absent.

``platform_devices(platform)``: every device of the platform (a mesh's); ``pick_device(name)``: one of them. The
twin of ``torch_impl.device``: asking for CUDA where JAX has no GPU backend is a ValueError naming the flag, never a
silent fall-back to the CPU. ``mesh_from_flags(mesh, device, strategy)``: the mesh of ``--mesh`` (e.g.
``dp=2,fsdp=-1``; None: one device) over those devices and its sharding strategy, for every JAX CLI (the step
benchmark, the trainer); ``device_name`` and ``peak_memory_bytes(mesh)`` describe the devices in records.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from jax_impl.sharding import make_mesh, strategy_for
from parallelism_calc.specs import ParallelSpec


def platform_devices(platform: str) -> list[jax.Device]:
    """Every device of ``--device``'s platform: auto (JAX's default backend), cpu or cuda."""
    if platform not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device {platform!r}; accepted: auto, cpu, cuda")
    if platform == "auto":
        return jax.devices()
    try:
        return jax.devices("cpu" if platform == "cpu" else "gpu")
    except RuntimeError:
        raise ValueError(f"--device {platform}: JAX has no {platform} backend here; accepted: cpu, auto") from None


def pick_device(name: str) -> jax.Device:
    """``--device``: auto (JAX's default device), cpu, cuda or cuda:N (the N-th GPU)."""
    platform, _, index = name.partition(":")
    if platform not in ("auto", "cpu", "cuda") or (index and (platform == "auto" or not index.isdigit())):
        raise ValueError(f"--device {name!r}; accepted: auto, cpu, cuda, cuda:N")
    devices = platform_devices(platform)
    if int(index or 0) >= len(devices):
        raise ValueError(f"--device {name}: only {len(devices)} {platform} device(s)")
    return devices[int(index or 0)]


def mesh_from_flags(mesh: str | None, device: str, strategy: str | None = None) -> tuple[Mesh, str]:
    """The mesh of ``--mesh`` over the first devices of ``--device``'s platform (no ``--mesh``: a 1-device mesh of
    ``--device``), and ``strategy`` or the one its degrees call for (``jax_impl.sharding.strategy_for``)."""
    if not mesh:
        built = make_mesh(ParallelSpec(), [pick_device(device)])
    else:
        if ":" in device:
            raise ValueError(f"--device {device} names one device; with --mesh use auto, cpu or cuda")
        parallel = ParallelSpec.parse(mesh)
        devices = platform_devices(device)
        wanted = int(np.prod([d for d in parallel.degrees().values() if d != -1]))
        if parallel.is_resolved:
            if wanted > len(devices):
                raise ValueError(f"--mesh {mesh} needs {wanted} devices; {len(devices)} available")
            devices = devices[:wanted]
        built = make_mesh(parallel, devices)
    resolved = ParallelSpec(**{axis: int(size) for axis, size in built.shape.items()})
    return built, strategy or strategy_for(resolved)


def device_name(device: jax.Device) -> str:
    return "cpu" if device.platform == "cpu" else device.device_kind


def peak_memory_bytes(mesh: Mesh) -> int | None:
    """The largest allocator peak over the mesh's devices, every process's (None where not reported: CPU)."""
    peaks = []
    for device in mesh.devices.flat:
        if device.process_index == jax.process_index():
            stats = device.memory_stats() or {}
            peaks.append(int(stats.get("peak_bytes_in_use", -1)))
    local = min(peaks) if peaks and min(peaks) < 0 else max(peaks, default=-1)  # -1: a device did not report
    if jax.process_count() > 1:  # a collective: every process calls it
        from jax.experimental import multihost_utils

        local = max_over_processes(local, multihost_utils.process_allgather)
    return None if local < 0 else local


def max_over_processes(value: int, allgather) -> int:
    """The largest of every process's ``value`` (bytes >= 0, or -1 for unknown: then -1), through ``allgather``
    (``multihost_utils.process_allgather``). JAX without x64 gathers 32-bit integers, which wrapped a 43.9 GB peak
    to 0.9 GB (results/profiles/jax_memory_probe_2xh200_d0bff64.txt): each value goes as two 31-bit halves."""
    halves = np.array([value >> 31, value & (2**31 - 1)] if value >= 0 else [-1, 0], np.int32)
    every = np.asarray(allgather(halves)).reshape(-1, 2).astype(np.int64)
    return -1 if (every[:, 0] < 0).any() else int((every[:, 0] * 2**31 + every[:, 1]).max())

"""What each JAX process's devices report as their memory (``Device.memory_stats()``) when one process drives both
GPUs and when each of two processes drives one (issue 23: the two-process e2e run recorded a 0.9 GB peak where the
one-process run's was 40.9 GB). Each process puts a 2 GiB array on every GPU of a mesh over all devices (each
device's shard 2 GiB), runs a jitted sum over it, and prints one JSON line per local device: the stats before,
after the allocation and after the sum, beside ``jax_impl.device.peak_memory_bytes``.
``PYTHONPATH=. python3 scripts/jax_memory_probe.py`` (one process) or under ``torchrun --nproc-per-node 2``."""

from __future__ import annotations

import json
import sys

from jax_impl.distributed import initialize_from_env

KEYS = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit", "bytes_reserved", "largest_alloc_size", "num_allocs")


def main(argv: list[str] | None = None) -> int:
    import argparse

    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    initialize_from_env()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jax_impl.device import peak_memory_bytes

    def stats() -> dict:
        return {str(d): {k: (d.memory_stats() or {}).get(k) for k in KEYS} for d in jax.local_devices()}

    mesh = Mesh(np.array(jax.devices()), ("x",))
    before = stats()
    per_device = 2**31 // 4  # 2 GiB of float32 a device
    x = jax.make_array_from_callback((per_device * len(jax.devices()),), NamedSharding(mesh, P("x")),
                                     lambda index: np.ones(per_device, np.float32))
    allocated = stats()
    total = float(jax.jit(jnp.sum)(x))
    after = stats()
    peak = peak_memory_bytes(mesh)
    for device in jax.local_devices():
        name = str(device)
        print(json.dumps({"process": jax.process_index(), "processes": jax.process_count(), "device": name,
                          "device_id": device.id, "mesh_device_objects_local": [
                              str(d) for d in mesh.devices.flat if d.process_index == jax.process_index()],
                          "before": before[name], "allocated": allocated[name], "after": after[name],
                          "sum": total, "peak_memory_bytes": peak}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The devices a JAX command line asks for: ``--device auto | cpu | cuda`` (``cuda:N`` for one), refused when absent.

``platform_devices(platform)``: every device of the platform (a mesh's); ``pick_device(name)``: one of them. The
twin of ``torch_impl.device``: asking for CUDA where JAX has no GPU backend is a ValueError naming the flag, never a
silent fall-back to the CPU.
"""

from __future__ import annotations

import jax


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

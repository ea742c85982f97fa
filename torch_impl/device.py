"""The device a command line asks for: ``--device auto | cpu | cuda | cuda:N``, refused when it cannot be had.

``pick_device(name)`` is the one place that turns the flag into a ``torch.device``: ``auto`` is CUDA when a GPU
is visible, else the CPU; asking for CUDA on a machine without it is a ValueError naming the flag (never a
silent fall-back to the CPU, never an ``AssertionError`` from deep inside torch). ``device_name`` is what a
record's provenance calls the device.
"""

from __future__ import annotations

import torch


def pick_device(name: str) -> torch.device:
    """``auto`` (CUDA if available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``, checked against the machine."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA device is available; accepted here: cpu, auto")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r}; accepted: auto, cpu, cuda, cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name!r}; accepted: auto, cpu, cuda, cuda:N")
    return device


def device_name(device: torch.device) -> str:
    """The GPU's name (e.g. 'NVIDIA H100 80GB HBM3'), or 'cpu'."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"

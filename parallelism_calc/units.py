"""Byte sizes as benchmarks take them on the command line: ``parse_size("1MB") == 2**20``, ``size_label``.

Binary units, as torch DDP's ``bucket_cap_mb`` and the CS336 handout use them: KB = KiB = 2**10, MB = MiB =
2**20, GB = GiB = 2**30 bytes; a bare number is bytes. (Bandwidths, in contrast, are reported in decimal
GB/s = 10**9 bytes/s, as nccl-tests does.) Stdlib only.
"""

from __future__ import annotations

import re

FLOAT32_BYTES = 4
_UNITS = {"": 1, "B": 1, "KB": 2**10, "KIB": 2**10, "MB": 2**20, "MIB": 2**20, "GB": 2**30, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'1MB' -> 1048576: binary units (KB/KiB = 2**10, MB/MiB = 2**20, GB/GiB = 2**30); a bare number is
    bytes. The size must be a positive multiple of 4 bytes (float32)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"size {text!r}; write e.g. 4096, 64KB, 1MB, 1GB (binary units)")
    nbytes = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if nbytes <= 0 or nbytes != int(nbytes) or int(nbytes) % FLOAT32_BYTES:
        raise ValueError(f"size {text!r} = {nbytes:g} bytes must be a positive multiple of {FLOAT32_BYTES}")
    return int(nbytes)


def size_label(nbytes: int) -> str:
    """1048576 -> '1MB' (binary units, as parsed by ``parse_size``)."""
    for unit, scale in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"

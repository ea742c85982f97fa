"""The calculator's reports: named quantities with units and formulas, rendered as text or as JSON.

A ``Report`` is built once from numbers and rendered twice — ``to_text()`` (with ``explain=True`` each
formula is printed with the numbers substituted) and ``to_dict()`` for ``--json`` — so the two outputs
cannot disagree. Byte counts are decimal (1 GB = 1e9 bytes), as device memory is quoted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

UNITS = ("", "params", "bytes", "bytes/token", "s", "tokens", "tokens/device", "devices", "FLOP", "FLOP/token",
         "FLOP/s", "bytes/s", "degree")


@dataclass(frozen=True)
class Quantity:
    """One result: ``value`` in ``unit``, how it is computed (``formula``) and with which numbers (``substituted``)."""

    key: str
    label: str
    value: float | int | bool | None
    unit: str = ""
    formula: str = ""
    substituted: str = ""
    note: str = ""  # why the value is None, or what to read into it

    def __post_init__(self) -> None:
        if self.unit not in UNITS:
            raise ValueError(f"Quantity {self.key!r}: unit {self.unit!r}; accepted: {UNITS}")


@dataclass(frozen=True)
class Section:
    key: str
    title: str
    quantities: tuple[Quantity, ...]
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Report:
    title: str
    assumptions: tuple[str, ...]
    sections: tuple[Section, ...]
    inputs: dict[str, Any] = field(default_factory=dict)

    def quantity(self, section: str, key: str) -> Quantity:
        """The quantity ``key`` of section ``section`` (a KeyError names what exists)."""
        for s in self.sections:
            if s.key == section:
                for q in s.quantities:
                    if q.key == key:
                        return q
                raise KeyError(f"no quantity {key!r} in section {section!r}: {[q.key for q in s.quantities]}")
        raise KeyError(f"no section {section!r}: {[s.key for s in self.sections]}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "inputs": self.inputs,
            "assumptions": list(self.assumptions),
            "sections": {
                s.key: {
                    "title": s.title,
                    "quantities": {
                        q.key: {"label": q.label, "value": q.value, "unit": q.unit, "formula": q.formula,
                                "substituted": q.substituted, "note": q.note}
                        for q in s.quantities
                    },
                    "notes": list(s.notes),
                }
                for s in self.sections
            },
        }

    def to_text(self, explain: bool = False) -> str:
        lines = [self.title, "=" * len(self.title), "", "Assumptions:"]
        lines += [f"  - {a}" for a in self.assumptions]
        for s in self.sections:
            lines += ["", s.title, "-" * len(s.title)]
            width = max(len(q.label) for q in s.quantities)
            for q in s.quantities:
                text = format_value(q.value, q.unit)
                if q.note:
                    text = q.note if q.value is None else f"{text}  ({q.note})"
                lines.append(f"  {q.label:<{width}}  {text}")
                if explain and q.formula:
                    lines.append(f"  {'':<{width}}    = {q.formula}")
                    if q.substituted:
                        lines.append(f"  {'':<{width}}    = {q.substituted}")
            lines += [f"  * {n}" for n in s.notes]
        return "\n".join(lines)


def format_value(value: float | int | None, unit: str) -> str:
    """A value for people: bytes in GB/MB/kB, seconds in ms/us, large counts with separators."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value == 0:
        return f"0 {unit}".rstrip()
    if unit in ("bytes", "bytes/token"):
        suffix = "" if unit == "bytes" else "/token"
        for scale, name in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
            if abs(value) >= scale:
                return f"{value / scale:,.2f} {name}{suffix} ({value:,.0f} bytes)"
        return f"{value:,.0f} bytes{suffix}"
    if unit == "s":
        for scale, name in ((1, "s"), (1e-3, "ms"), (1e-6, "us")):
            if abs(value) >= scale:
                return f"{value / scale:,.3f} {name}"
        return f"{value * 1e9:,.3f} ns"
    if unit in ("FLOP", "FLOP/token", "FLOP/s", "bytes/s"):
        return f"{value:.4g} {unit}"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) >= 1000):
        return f"{int(value):,} {unit}".rstrip()
    return f"{value:,.1f} {unit}".rstrip() if abs(value) >= 100 else f"{value:.4g} {unit}".rstrip()


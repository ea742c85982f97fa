"""The import rules of DESIGN.md, read from the source (every import, those inside functions too): no library module
of a backend imports a benchmark or a CLI; the trainer, the benchmarks and the studies import only library modules;
``analysis`` and ``parallelism_calc`` import neither backend.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# An entry point may import another only as an alias of its CLI: the naive attention benchmark is the attention
# benchmark's "naive" preset under its own name.
ALIASES = {"torch_impl.bench.naive_attention": {"torch_impl.bench.attention"}}


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports; ``from a import b`` counts as a and a.b (b may be a module)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return names


def _modules(package: str) -> dict[str, Path]:
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
            for p in sorted((ROOT / package).rglob("*.py"))}


def _is_entry_point(module: str) -> bool:
    """A benchmark, a study or the trainer: run, never imported by a library."""
    return module.startswith(("torch_impl.bench.", "jax_impl.bench.")) or module == "torch_impl.train"


def test_libraries_import_no_entry_point_and_entry_points_only_libraries():
    wrong = []
    for package in ("torch_impl", "jax_impl"):
        for module, path in _modules(package).items():
            ours = {name for name in _imports(path) if name.startswith(("torch_impl", "jax_impl"))}
            bad = {name for name in ours if _is_entry_point(name)} - ALIASES.get(module, set())
            wrong += [f"{module} imports {name}" for name in sorted(bad)]
    assert not wrong, "\n".join(wrong)


def test_analysis_and_the_calculator_import_neither_backend():
    wrong = [f"{module} imports {name}" for package in ("analysis", "parallelism_calc")
             for module, path in _modules(package).items() for name in sorted(_imports(path))
             if name.split(".")[0] in ("torch_impl", "jax_impl", "torch", "jax", "flax", "triton")]
    assert not wrong, "\n".join(wrong)

"""``scripts/grad_fidelity.py`` (its GPU runs: notes/train_step.md, session 50): its summary's arithmetic, and on
the CPU that a step computed like its reference matches it while a bf16_mixed step shows bf16's rounding."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

_spec = importlib.util.spec_from_file_location(
    "grad_fidelity", Path(__file__).resolve().parents[1] / "scripts" / "grad_fidelity.py")
grad_fidelity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(grad_fidelity)


def test_kind_and_summary():
    assert grad_fidelity.kind("layers.11.ffn.w1.weight") == "ffn.w1"
    assert grad_fidelity.kind("token_embeddings.weight") == "token_embeddings"
    ref = torch.randn(50, dtype=torch.float64)
    s = grad_fidelity.summary(grad_fidelity.sums(2 * ref, ref))  # twice the reference: all in the scale
    assert s["rel_err"] == pytest.approx(1.0) and s["cosine"] == pytest.approx(1.0)
    assert s["scale"] == pytest.approx(1.0) and s["sign_diff"] == 0.0
    s = grad_fidelity.summary(grad_fidelity.sums(-ref, ref))
    assert s["cosine"] == pytest.approx(-1.0) and s["scale"] == pytest.approx(-2.0) and s["sign_diff"] == 1.0


def _run(tmp_path: Path, dtype: str) -> dict:
    out = tmp_path / dtype
    code = grad_fidelity.main([str(out), "--variants", "sdpa:torch", "--batches", "2", "--model", "tiny",
                               "--batch-size", "2", "--seq-len", "32", "--dtype", dtype, "--steps-per-epoch", "3",
                               "--val-batches", "0", "--device", "cpu", "--no-progress", "--cache-dir",
                               str(tmp_path / "data")])
    assert code == 0
    return json.loads((out / "grad_fidelity.json").read_text())["variants"]["sdpa:torch"]


def test_fp32_step_matches_its_reference_and_bf16_shows_rounding(tmp_path):
    fp32, bf16 = _run(tmp_path, "fp32"), _run(tmp_path, "bf16_mixed")
    assert set(fp32) == {"initial", "trained_3"}
    for point in fp32:
        assert max(s["rel_err"] for s in fp32[point]["kinds"].values()) < 1e-4  # the same sums, batched otherwise
        assert max(map(abs, fp32[point]["loss_minus_ref"])) < 1e-5
        # bf16 keeps 8 mantissa bits: rounding errors of ~2^-9 relative and more, not of a wrong gradient's ~1
        assert 1e-4 < bf16[point]["kinds"]["all"]["rel_err"] < 5e-2
        assert bf16[point]["kinds"]["all"]["cosine"] > 0.999

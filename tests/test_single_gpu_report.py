"""analysis.single_gpu from real CPU records of torch_impl.bench.e2e (tiny), through analysis.reports.

CPU runs carry no allocator peak, so the checkpointing test gives its records peaks drawn at random and
checks that the reported measured k is the argmin of those, next to the calculator's predicted k.
"""

from __future__ import annotations

import random

from analysis.records import append_records, read_records
from analysis.reports import write_reports
from parallelism_calc.checkpointing import best_checkpoint_every
from parallelism_calc.specs import MODELS
from torch_impl.bench import e2e

FLAGS = ["--model", "tiny", "--batch-size", "2", "--warmup", "0", "--steps", "1", "--device", "cpu"]


def test_memory_kernel_and_checkpointing_reports(tmp_path):
    results = tmp_path / "results"
    for seq in ("16", "32"):
        for mode in ("forward", "train_step"):
            assert e2e.main([*FLAGS, "--seq-len", seq, "--mode", mode, "--suite", "memory",
                             "--out", str(results / "memory.jsonl")]) == 0
    assert e2e.main([*FLAGS, "--seq-len", "16", "--profile", str(tmp_path / "prof"), "--suite", "kernels",
                     "--out", str(results / "kernels.jsonl")]) == 0
    policies = [[], ["--ac-every", "1"], ["--ac-every", "2"], ["--ac-every", "1", "--nested-checkpoint"],
                ["--ac-every", "2", "--nested-checkpoint"]]
    staged = tmp_path / "checkpointing_cpu.jsonl"
    for policy in policies:
        assert e2e.main([*FLAGS, "--seq-len", "16", *policy, "--suite", "checkpointing", "--out", str(staged)]) == 0
    records = read_records(staged)
    rng = random.Random()
    for r in records:
        r.peak_memory_bytes = rng.randrange(10**6, 10**7)
    append_records(results / "checkpointing.jsonl", records)

    out = tmp_path / "reports"
    write_reports(results, out)
    memory = (out / "memory.md").read_text()
    assert "fp32 forward_peak_memory_bytes" in memory and "predicted_peak_bytes" in memory
    kernels = (out / "kernels.md").read_text()
    assert "matmul_share" in kernels and kernels.count("| tiny") == 1
    ckpt = (out / "checkpointing.md").read_text()
    for label in ("none", "every 1", "every 2", "every 1 nested", "every 2 nested"):
        assert f"| {label} " in ckpt
    peaks = {(r.metrics["checkpoint_every"], bool(r.metrics["nested_checkpoint"])): r.peak_memory_bytes
             for r in records if r.metrics["checkpoint_every"]}
    for nested in (False, True):
        measured = min((k for k, n in peaks if n == nested), key=lambda k: peaks[(k, nested)])
        predicted = best_checkpoint_every(MODELS["tiny"], 16, "fp32", nested, "naive")
        assert f"- {'nested' if nested else 'flat'}: k minimizing peak memory measured {measured} " in ckpt
        assert f"predicted {predicted}" in ckpt
    assert any(p.suffix == ".png" for p in out.iterdir() if p.name.startswith("checkpointing"))

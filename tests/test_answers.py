"""The single-GPU answer pages (``analysis.answers``) are computed from the records: change a record, the page
changes; and the reference sheet's tables are read from its text (``analysis.reference_sheets``)."""

from __future__ import annotations

import json
import random

from analysis.answers import write_answers
from analysis.records import Record, save_records
from analysis.reference_sheets import main as reference_main, parse

SHEET = """# benchmarking_script
Model      Params       Forward (s)     Backward (s)
small_seq128 128,625,408 0.024990±0.003563 0.038322±0.002954
2.7B_seq512 3,406,809,600 0.876249±0.001014 1.822075±0.002266
# benchmarking_mixed_precision
large_seq128 BF16       969,411,840 0.156829±0.007042 0.284106±0.011902
large_seq128 BF16       969,411,840 0.563264±0.016795
# torch_compile
uncompiled   16         256        0.22 ± 0.47          0.90 ± 1.89          10.62              25.25              ✓
compiled     16         256        0.30 ± 0.15          0.65 ± 0.92          18.75              21.38              ✓
"""


def test_reference_sheet_rows_are_read_from_the_text(tmp_path):
    found = parse(SHEET)
    small, big, bf16, step = found["benchmark"]
    assert (small["section"], small["model"], small["seq_len"], small["precision"]) == ("benchmarking_script", "small",
                                                                                      128, None)
    assert small["first_s"] == 0.024990 and small["backward_std_s"] == 0.002954 and big["params"] == 3_406_809_600
    assert bf16["precision"] == "bf16" and step["backward_s"] is None and step["first_s"] == 0.563264
    eager, compiled = found["attention"]
    assert not eager["compiled"] and compiled["compiled"] and compiled["backward_ms"] == 0.65
    assert eager["mb_before_backward"] == 10.62 and eager["ok"]
    (tmp_path / "sheet.txt").write_text(SHEET)
    assert reference_main([str(tmp_path / "sheet.txt"), "--out", str(tmp_path / "ref.json")]) == 0
    assert json.loads((tmp_path / "ref.json").read_text())["sheet"] == "sheet.txt"


def _sweep_record(dtype: str, compiled: bool, model: str, seq: int, step_ms: float) -> Record:
    stats = lambda ms: {"mean_ms": ms, "std_ms": ms / 50, "median_ms": ms, "min_ms": ms, "max_ms": ms}  # noqa: E731
    return Record(suite="e2e_sweep", backend="torch", implementation=f"{'compiled' if compiled else 'eager'} sdpa",
                  model=model, batch_size=4, seq_len=seq, dtype=dtype, mode="train_step", timing=stats(step_ms),
                  phases={"forward": stats(step_ms / 3), "backward": stats(step_ms * 2 / 3)},
                  metrics={"warmup_step_ms": [step_ms * 40, step_ms, step_ms]})


def _write_sweep(results, times: dict) -> None:
    for (dtype, compiled), by_config in times.items():
        path = results / f"e2e_sweep_{dtype}_{'compiled' if compiled else 'eager'}_h100.jsonl"
        path.unlink(missing_ok=True)
        save_records(path, [_sweep_record(dtype, compiled, model, seq, ms) for (model, seq), ms in by_config.items()])


def test_answer_pages_follow_the_records(tmp_path):
    """The benchmarking and mixed-precision pages state numbers computed from the sweep's records, beside the
    reference sheet's where a configuration matches; a changed record changes the page."""
    results, out = tmp_path / "results", tmp_path / "answers"
    results.mkdir()
    (results / "reference_004.json").write_text(json.dumps({"sheet": "sheet.txt", **parse(SHEET)}))
    rng = random.Random()
    configs = [(model, seq) for model in ("small", "large") for seq in (128, 256)]
    times = {(dtype, compiled): {config: rng.uniform(50, 500) for config in configs}
             for dtype in ("fp32", "bf16") for compiled in (False, True)}
    _write_sweep(results, times)
    written = write_answers(results, out)
    assert {p.name for p in written} == {"benchmarking.md", "mixed_precision.md", *(
        f"{chart}.{kind}" for chart in ("benchmarking_step", "mixed_precision_speedup") for kind in ("png", "pdf"))}
    page = (out / "benchmarking.md").read_text()
    assert "](benchmarking_step.png)" in page  # the step times' chart, in the page that tabulates them
    eager_fp32 = times[("fp32", False)][("small", 128)]
    assert f"{eager_fp32:.1f} ± {eager_fp32 / 50:.1f}" in page  # the step's mean ± std, as recorded
    assert "the backward takes 2.00x the forward" in page
    theirs = 24.990 / (eager_fp32 / 3)  # their forward over ours, at small x 128
    assert "## Beside the reference sheet (`sheet.txt`" in page and f"{theirs:.4g}" in page
    speedup = (out / "mixed_precision.md").read_text()
    ratio = times[("fp32", True)][("large", 256)] / times[("bf16", True)][("large", 256)]
    assert f"{ratio:.4g}" in speedup

    times[("fp32", False)][("small", 128)] = 777.7
    _write_sweep(results, times)
    write_answers(results, out)
    changed = (out / "benchmarking.md").read_text()
    # the old step's cell is gone (another cell may show the same digits: a forward, mean and std, is a third of a
    # step's, so count rather than look for it; the random times made this fail about once in a hundred runs)
    old = f"{eager_fp32:.1f} ± {eager_fp32 / 50:.1f}"
    assert changed != page and "777.7 ± 15.6" in changed and changed.count(old) == page.count(old) - 1

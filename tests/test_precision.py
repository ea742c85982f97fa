"""The mixed-precision experiments against an independent numpy (and ml_dtypes bfloat16) computation."""

import ml_dtypes
import numpy as np
import pytest

from analysis.records import read_records
from torch_impl.bench import precision

NUMPY = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}


def numpy_accumulate(accumulator, addend, upcast, steps=1000):
    total, term = NUMPY[accumulator](0), NUMPY[addend](0.01)
    for _ in range(steps):
        total = NUMPY[accumulator](total + (NUMPY[accumulator](term) if upcast else term))
    return float(total)


@pytest.mark.parametrize("accumulator,addend,upcast", precision.ACCUMULATIONS)
def test_accumulation_matches_numpy(accumulator, addend, upcast):
    assert precision.accumulate(accumulator, addend, upcast) == numpy_accumulate(accumulator, addend, upcast)


def test_the_lesson_of_the_table():
    exact = 10.0
    errors = {(a, b, u): abs(precision.accumulate(a, b, u) - exact) for a, b, u in precision.ACCUMULATIONS}
    assert errors[("fp32", "fp32", False)] < 1e-3 < errors[("fp16", "fp16", False)] < errors[("bf16", "bf16", False)]
    assert errors[("fp32", "fp16", False)] < errors[("fp16", "fp16", False)]  # an fp32 accumulator rescues fp16


def test_autocast_dtypes_on_cpu():
    dtypes = precision.autocast_dtypes("bf16")
    assert dtypes["parameters"] == dtypes["gradients"] == "torch.float32"
    assert dtypes["fc1 output"] == dtypes["logits"] == "torch.bfloat16"
    assert dtypes["loss"] == "torch.float32"
    assert precision.autocast_dtypes("fp16")["fc1 output"] == "torch.float16"


def test_cli_writes_records_and_tables(tmp_path, capsys):
    out, table = tmp_path / "precision.jsonl", tmp_path / "precision.md"
    assert precision.main(["--out", str(out), "--table", str(table), "--autocast", "bf16"]) == 0
    rows = read_records(out)
    assert len(rows) == len(precision.ACCUMULATIONS) + 1
    assert "| fp16 | fp16 | 9.953125 |" in table.read_text()  # the CS336 handout's fp16 result
    with pytest.raises(SystemExit, match="accepted: bf16, fp16"):
        precision.main(["--autocast", "fp8"])

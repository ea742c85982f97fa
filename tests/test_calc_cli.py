"""The calculator's CLI: the XXL report's worked numbers, text and JSON agreeing, speed, and one-line errors."""

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parallelism_calc.__main__ import main

README = Path(__file__).resolve().parent.parent / "README.md"

XXL_PARAMS = 219_848_638_464  # 126 blocks x 2 x 16,384 x 53,248


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def xxl_json(capsys, *argv):
    code, out, _ = run(capsys, "xxl", "--fsdp", "16", "--tp", "4", "--json", *argv)
    assert code == 0
    return json.loads(out)["sections"]


def test_xxl_worked_numbers(capsys):
    q = {k: v["value"] for s in xxl_json(capsys, "--batch-tokens", "4096").values() for k, v in s["quantities"].items()}
    assert q["n_params"] == XXL_PARAMS
    assert q["state_bytes"] == 16 * XXL_PARAMS == 3_517_578_215_424
    assert q["activation_bytes_per_token"] == 126 * (16_384 + 53_248) * 2 == 17_547_264
    a = 17_547_264 * 4096
    assert q["activation_bytes"] == a
    assert q["devices_needed"] == math.ceil((16 * XXL_PARAMS + a) / 80e9)
    assert q["per_device_bytes"] == pytest.approx((16 * XXL_PARAMS + a / 2) / 16 + a / 2)
    n = q["min_fsdp"]  # the smallest N with (state + A/2) / N + A/2 <= 95 GB, found by counting
    fits = lambda k: (16 * XXL_PARAMS + a / 2) / k + a / 2 <= 95e9
    assert fits(n) and not fits(n - 1)
    alpha = 4.6e14 / 1.8e11
    assert q["min_batch_overlapped"] == pytest.approx(16 * alpha / 2)
    assert q["per_device_batch_overlapped"] == pytest.approx(16 * alpha / 2 / 64)
    assert q["max_tp"] == pytest.approx(53_248 / alpha)


def test_xxl_state_alone_and_smaller_batch_tricks(capsys):
    """(a) as the handout asks it, the fp32 state alone in 80 GB devices; (d) each trick's smallest compute-bound
    batch at X = 16, Y = 4 on v5p (alpha = C / W = 4.6e14 / 1.8e11, M_X = 2, M_Y = 1), from the book's conditions."""
    q = {k: v["value"] for s in xxl_json(capsys).values() for k, v in s["quantities"].items()}
    assert q["devices_for_state"] == 44  # 3.5176 TB / 80 GB = 43.97
    alpha, x, n, f = 4.6e14 / 1.8e11, 16, 64, 53_248
    assert q["overlap"] == pytest.approx(x * alpha / 2) and q["overlap"] < q["min_batch_serial"]
    assert q["fp8_gather"] == pytest.approx(x * alpha / 2 / 2)  # half the bytes per gathered weight
    assert q["more_tp"] == pytest.approx(n * alpha**2 / (2 * f))  # (c)'s best split, as a global batch
    assert q["more_tp"] == pytest.approx(q["best_per_device_batch_overlapped"] * n)
    assert q["pipeline"] == pytest.approx(x / 4 * alpha / 2)  # 4 stages: FSDP over 4 ranks per stage
    assert max(q["fp8_gather"], q["more_tp"], q["pipeline"]) < q["min_batch_overlapped"]


def test_text_and_json_agree(capsys):
    sections = xxl_json(capsys)
    _, text, _ = run(capsys, "xxl", "--fsdp", "16", "--tp", "4")
    for section in sections.values():
        assert section["title"] in text
        for quantity in section["quantities"].values():
            assert quantity["label"] in text
    # the numbers too: the parameter count and the overlapped batch, as printed
    compute = sections["compute_bound"]["quantities"]
    assert f"{XXL_PARAMS:,} params" in text
    assert f"{compute['min_batch_overlapped']['value']:,.1f} tokens" in text


def test_explain_substitutes_numbers(capsys):
    _, text, _ = run(capsys, "xxl", "--fsdp", "16", "--tp", "4", "--explain")
    assert "= L * 2 * D * F" in text and "= 126 * 2 * 16,384 * 53,248" in text
    assert "= X * alpha / M_X" in text.replace("B > ", "")


def test_budget_unreachable_is_reported_not_raised(capsys):
    sections = xxl_json(capsys, "--batch-tokens", "1e6")  # A/2 = 8.8 TB: no N_FSDP fits 95 GB
    quantity = sections["fsdp_memory"]["quantities"]["min_fsdp"]
    assert quantity["value"] is None and "exceeds the budget" in quantity["note"]


def test_hardware_and_roofline_flags(capsys):
    sections = xxl_json(capsys, "--hardware", "h100", "--mx", "1")
    alpha = sections["compute_bound"]["quantities"]["alpha"]["value"]
    assert alpha == pytest.approx(989.5e12 / 450e9)


def test_strategies_and_collectives(capsys):
    code, out, _ = run(capsys, "strategies", "xxl", "--devices", "64", "--batch-tokens", "1e6", "--tp", "4", "--json")
    assert code == 0
    sections = json.loads(out)["sections"]
    assert set(sections) == {"dp", "fsdp", "tp", "fsdp_tp"}
    dp = sections["dp"]["quantities"]
    assert dp["forward_weight_comm_s"]["value"] == 0 and dp["backward_weight_comm_s"]["value"] > 0
    assert dp["max_degree"]["value"] == pytest.approx(1e6 * 2 / (4.6e14 / 1.8e11))
    code, out, _ = run(capsys, "collectives", "--bytes", "1e9", "--devices", "4", "--bandwidth", "1e11", "--json")
    ring = json.loads(out)["sections"]["n4"]["quantities"]
    assert ring["all_reduce"]["value"] == pytest.approx(2 * 3 / 4 * 1e9 / 1e11)


@pytest.mark.parametrize("argv,message", [
    (["xxl", "--tp", "7"], "does not divide d_ff"),
    (["small", "--tp", "5", "--json"], "does not divide"),
    (["xxl", "--fsdp", "16", "--tp", "4", "--devices", "32"], "!= world size 32"),
    (["xxl", "--fsdp", "0"], "positive integer"),
    (["nope"], "unknown model preset"),
    (["xxl", "--batch-tokens", "-1"], "must be > 0"),
    (["xxl", "--d-ff", "0"], "must be > 0"),
    (["strategies", "xxl", "--devices", "64", "--batch-tokens", "1e6", "--fsdp", "8", "--tp", "4"], "!= 64 devices"),
    (["collectives", "--bytes", "1e9"], "required"),
])
def test_bad_input_is_one_line_and_status_2(argv, message):
    proc = subprocess.run([sys.executable, "-m", "parallelism_calc", *argv], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_is_fast_and_framework_free():
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "parallelism_calc", "xxl", "--fsdp", "16",
                           "--tp", "4"], capture_output=True, text=True, check=True)
    assert time.perf_counter() - start < 1.0
    imported = set(re.findall(r"\|\s+(\S+)$", proc.stderr, flags=re.M))
    assert not {"torch", "jax", "pandas", "numpy"} & {name.split(".")[0] for name in imported}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "parallelism_calc", "--help"], capture_output=True, check=True)
    assert time.perf_counter() - start < 1.0


def test_readme_shows_the_real_xxl_output(capsys):
    command = "$ python -m parallelism_calc xxl --fsdp 16 --tp 4\n"
    readme = README.read_text()
    shown = readme[readme.index(command) + len(command):].split("\n```", 1)[0]
    _, out, _ = run(capsys, "xxl", "--fsdp", "16", "--tp", "4")
    assert shown == out.rstrip("\n")


def test_transformer_preset_report(capsys):
    from parallelism_calc.memory import activation_bytes_per_token, per_device_memory
    from parallelism_calc.specs import MODELS, ParallelSpec

    code, out, _ = run(capsys, "small", "--fsdp", "4", "--tp", "2", "--seq-len", "512", "--batch-tokens", "8192",
                       "--json")
    assert code == 0
    sections = json.loads(out)["sections"]
    small, mesh = MODELS["small"], ParallelSpec(fsdp=4, tp=2)
    model = sections["model"]["quantities"]
    assert model["n_params"]["value"] == 128_625_408
    # forward FLOPs per token, written out: 2 L (4 d^2 + 3 d F + 2 T d) + 2 d V
    assert model["forward_flops_per_token"]["value"] == pytest.approx(
        2 * 12 * (4 * 768**2 + 3 * 768 * 3072 + 2 * 512 * 768) + 2 * 768 * 10_000)
    acts = sections["activations"]["quantities"]
    assert acts["selective_flash"]["value"] == activation_bytes_per_token(
        small, 512, "bf16_autocast", "selective", "flash", tp=2).total_bytes
    memory = sections["memory"]["quantities"]
    assert set(memory) == {"ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp_tp"}
    assert memory["zero2"]["value"] == per_device_memory(small, "zero2", 8, 8192, 512).total
    assert memory["fsdp_tp"]["value"] == per_device_memory(small, "fsdp_tp", mesh, 8192, 512).total
    assert memory["ddp"]["value"] > memory["zero1"]["value"] > memory["zero2"]["value"] > memory["zero3"]["value"]
    _, text, _ = run(capsys, "small", "--fsdp", "4", "--tp", "2", "--seq-len", "512", "--batch-tokens", "8192")
    assert f"{memory['fsdp_tp']['value']:,.0f} bytes" in text and "fits in 80 GB" in text


@pytest.mark.parametrize("argv,message", [
    (["small", "--seq-len", "4096"], "exceeds context_length"),
    (["small", "--batch-tokens", "1000"], "not a whole number of 1024-token sequences"),
    (["small", "--fsdp", "3", "--batch-tokens", "2048"], "not divisible by the 3 devices (dp 1 x fsdp 3 x tp 1)"),
    (["small", "--fsdp", "4", "--tp", "3", "--batch-tokens", "16384"], "the 12 devices (dp 1 x fsdp 4 x tp 3)"),
    (["lm8b", "--tp", "3"], "does not divide"),
])
def test_transformer_report_bad_input(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_hardware_preset_sets_memory_defaults(capsys):
    sections = xxl_json(capsys, "--hardware", "h200")
    assert sections["fsdp_memory"]["quantities"]["budget_bytes"]["value"] == 141e9
    _, out, _ = run(capsys, "small", "--hardware", "b200", "--json")
    memory = json.loads(out)["sections"]["memory"]["quantities"]
    assert memory["ddp"]["note"] == "fits in 180 GB"

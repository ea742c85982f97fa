"""The attention benchmark CLI: FLOP counts by hand, records (failures kept as rows), the report from records."""

import time

import matplotlib.image
import pytest
import torch

from analysis.records import ATTENTION_PROVIDERS, read_records
from parallelism_calc.compute import attention_flops
from torch_impl.bench import attention as bench

# The CPU sweep of the tests: tiny shapes, budgets of a few ms (timings meaningless, the plumbing is the point).
CPU = ["--device", "cpu", "--head-dims", "16", "--dtypes", "fp32", "--warmup", "0", "--rep", "2"]
PROVIDERS = ("naive", "flash_torch", "sdpa_flash", "sdpa_cudnn")  # sdpa_cudnn has no CPU kernel: an error row


def test_attention_flops_by_hand():
    # forward: Q Kᵀ and P V, each 2 * N * N * d FLOPs per (batch, head): 2 * 3 * (2 * 64*64*16) * 2 = 1,572,864
    assert attention_flops(2, 3, 64, 16, causal=False, pass_="forward") == 1_572_864
    assert attention_flops(2, 3, 64, 16, causal=True, pass_="forward") == 786_432  # half the matrix
    assert attention_flops(2, 3, 64, 16, causal=True, pass_="backward") == 1_966_080  # 2.5 x
    assert attention_flops(2, 3, 64, 16, causal=True, pass_="forward_backward") == 2_752_512  # 3.5 x
    with pytest.raises(ValueError, match="accepted: forward, backward, forward_backward"):
        attention_flops(1, 1, 16, 16, causal=True, pass_="train_step")


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("attention") / "attention.jsonl"
    code = bench.main([*CPU, "--seq-lens", "16,32", "--providers", ",".join(PROVIDERS), "--out", str(out)])
    assert code == 0
    return out


def test_cpu_sweep_writes_one_record_per_configuration(cpu_run):
    records = read_records(cpu_run)
    assert len(records) == 2 * len(PROVIDERS) * 3  # sequence lengths x providers x passes
    seen = {(r.implementation, r.mode, r.seq_len) for r in records}
    assert seen == {(p, m, n) for p in PROVIDERS for m in bench.PASSES for n in (16, 32)}
    for r in records:
        assert (r.suite, r.backend, r.batch_size, r.dtype) == ("attention", "torch", 1, "fp32")
        assert r.metrics["heads"] == 1 and r.metrics["head_dim"] == 16 and r.metrics["causal"] is True
        forward = 4 * 1 * 1 * r.seq_len**2 * 16 / 2  # causal: half of 4 B H N^2 d
        assert r.flops_per_step == {"forward": 1, "backward": 2.5, "forward_backward": 3.5}[r.mode] * forward
        assert r.provenance["device_name"] == "cpu"
        assert r.provenance["git_commit"] == records[0].provenance["git_commit"]  # asked once per sweep
    for r in records:
        if r.implementation in ("naive", "sdpa_flash"):
            assert r.status == "ok" and r.timed_steps >= 3 and r.timing["median_ms"] > 0
            assert r.tflops == pytest.approx(r.flops_per_step / (r.timing["median_ms"] / 1e3) / 1e12)
            assert r.tokens_per_s == pytest.approx(r.seq_len / (r.timing["median_ms"] / 1e3))
            assert r.mfu is None and r.peak_memory_bytes is None  # no HardwareSpec, no CUDA allocator on a CPU
            assert r.metrics["host_ms"] is None  # the host's share is measured against a GPU only
        elif r.implementation == "sdpa_cudnn":
            assert r.status == "error" and r.timing is None and r.tflops is None
            assert r.error.startswith("RuntimeError: ") and "\n" not in r.error


def test_cpu_sweep_writes_table_and_plots_next_to_the_records(cpu_run):
    table = cpu_run.with_suffix(".md").read_text()
    assert "## Median time (ms)" in table and "## TFLOP/s" in table and "## Failed runs" in table
    header = next(line for line in table.splitlines() if line.startswith("| mode"))
    columns = ["mode", "seq_len", "flash_torch", "naive", "sdpa_flash", "sdpa_cudnn"]  # ours first, as in --help
    assert [c.strip() for c in header.strip("|").split("|")] == columns
    assert "| error " in table  # sdpa_cudnn's cells show the failure, not a blank
    assert "## Host time" not in table  # no CUDA run, no host time
    for name in ("latency", "tflops"):
        png = cpu_run.parent / f"attention_{name}_fp32.png"
        assert png.stat().st_size > 10_000
        height, width, _ = matplotlib.image.imread(png).shape
        assert height > 300 and width > 300


def test_report_only_regenerates_from_records(cpu_run, tmp_path, capsys):
    copy = tmp_path / "copy.jsonl"
    copy.write_text(cpu_run.read_text())
    assert bench.main(["--report-only", str(copy)]) == 0
    assert (tmp_path / "copy.md").read_text() == cpu_run.with_suffix(".md").read_text()
    assert {p.name for p in tmp_path.glob("*.png")} == {"copy_latency_fp32.png", "copy_tflops_fp32.png"}
    assert "wrote" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no such file"):
        bench.main(["--report-only", str(tmp_path / "missing.jsonl")])


def test_host_time_is_the_enqueue_time_of_a_run_with_gradients_reset(monkeypatch):
    """``_host_ms`` on CUDA: the median over rounds of the time a call takes to return (the GPU synchronized around
    each round, not after each call), the inputs' gradients reset before each call as do_bench resets them."""
    synchronized, calls = [], []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: synchronized.append(None))  # torch_impl.timing.enqueue_ms
    leaf = torch.zeros(2, requires_grad=True)

    def run():
        calls.append(leaf.grad)
        leaf.grad = torch.ones(2)
        time.sleep(0.002)

    host = bench._host_ms(run, torch.device("cuda"), [leaf], calls=3, rounds=4)
    assert 2.0 <= host < 20 and len(calls) == 12 and all(g is None for g in calls) and len(synchronized) == 5
    assert bench._host_ms(run, torch.device("cpu"), [leaf]) is None


def test_report_shows_the_host_time_where_records_have_it(cpu_run):
    """CUDA records keep ``metrics.host_ms``: the report gets a table of it, providers as columns."""
    from analysis.attention import attention_markdown

    records = read_records(cpu_run)
    for i, r in enumerate(records):
        r.metrics["host_ms"] = 0.125 * (i + 1) if r.status == "ok" else None
    table, _ = attention_markdown(records)
    section = table.split("## Host time a run (ms)")[1].split("##")[0]
    ok = [r for r in records if r.status == "ok"]
    assert ok and all(f"| {r.metrics['host_ms']:.3f} " in section for r in ok)  # each value distinct


def test_missing_module_and_oom_are_rows_not_gaps(tmp_path, monkeypatch):
    def out_of_memory(shape, device):
        def call(q, k, v):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

        return call

    monkeypatch.setitem(bench.PROVIDERS, "flash_triton", bench._flash("torch_impl.attention.no_such_module", "X"))
    monkeypatch.setitem(bench.PROVIDERS, "flex", out_of_memory)
    out = tmp_path / "a.jsonl"
    flags = ["--seq-lens", "16", "--providers", "flash_triton,flex", "--no-report", "--out", str(out)]
    assert bench.main([*CPU, *flags]) == 0
    records = read_records(out)
    assert [(r.implementation, r.mode, r.status) for r in records] == [
        *[("flash_triton", m, "error") for m in bench.PASSES], *[("flex", m, "oom") for m in bench.PASSES]]
    assert records[0].error == "RuntimeError: module torch_impl.attention.no_such_module is missing"
    assert records[-1].error.startswith("OutOfMemoryError: CUDA out of memory")
    assert not out.with_suffix(".md").exists()  # --no-report


def test_do_bench_falls_back_to_the_median_where_return_mode_all_is_missing(monkeypatch):
    import triton.testing

    calls = []

    def old_do_bench(fn, warmup=25, rep=100, grad_to_none=None, quantiles=None, return_mode="mean"):
        calls.append(return_mode)
        assert return_mode in ["min", "max", "mean", "median"]
        return 1.5

    monkeypatch.setattr(triton.testing, "do_bench", old_do_bench)
    monkeypatch.setattr(bench, "_DO_BENCH_ALL", None)
    assert bench._do_bench(lambda: None, 1, 1, []) == [1.5]
    assert bench._do_bench(lambda: None, 1, 1, []) == [1.5]
    assert calls == ["all", "median", "median"]  # "all" is tried once


def test_presets_flags_and_bad_input(capsys):
    assert bench.main(["--preset", "leaderboard", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2  # head dims 64 and 128
    assert "Shape(batch=1, heads=16, seq_len=16384, head_dim=64, dtype='bf16', causal=True)" in lines[0]
    assert bench.main(["--dry-run", "--no-causal", "--heads", "4", "--seq-lens", "1_024", "--head-dims", "64"]) == 0
    assert capsys.readouterr().out.count("heads=4, seq_len=1024, head_dim=64") == 2  # bf16, fp32 (cs336)
    assert bench.main(["--dry-run"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 10 * 4 * 2  # cs336: seq 128..65536 x d 16..128 x dtypes
    with pytest.raises(SystemExit):
        bench.main(["--providers", "naive,cudnn"])
    assert "cudnn; accepted: flash_triton" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="argument --heads: '0': must be > 0"):
        bench.main(["--heads", "0", "--dry-run"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_without_cuda_the_default_device_exits_with_one_line():
    with pytest.raises(SystemExit, match="no CUDA device is available"):
        bench.main(["--seq-lens", "16", "--head-dims", "16"])


@pytest.mark.gpu
def test_gpu_sweep_all_providers(tmp_path):
    out = tmp_path / "gpu.jsonl"
    assert bench.main(["--seq-lens", "256", "--head-dims", "64", "--dtypes", "bf16,fp32", "--warmup", "5",
                       "--rep", "20", "--out", str(out)]) == 0
    records = {(r.implementation, r.mode, r.dtype): r for r in read_records(out)}
    assert len(records) == len(bench.PROVIDERS) * 3 * 2
    for provider in ("flash_triton", "naive", "sdpa_cudnn", "sdpa_flash"):
        for pass_ in bench.PASSES:
            r = records[(provider, pass_, "bf16")]
            assert r.status == "ok", r.error
            assert r.peak_memory_bytes > 0 and 0 < r.tflops
            assert r.mfu is None or 0 < r.mfu < 1
    assert records[("sdpa_flash", "forward", "fp32")].status == "error"  # FlashAttention has no fp32 kernel
    assert (tmp_path / "gpu_latency_bf16.png").exists()


def test_every_provider_the_report_names_has_a_builder():
    """The names and their order live torch-free in analysis.records, for the benchmark and its report alike."""
    assert set(bench.PROVIDERS) == set(ATTENTION_PROVIDERS)
    assert bench.resolve_args(bench.build_parser().parse_args([])).providers == list(ATTENTION_PROVIDERS)


@pytest.mark.parametrize("causal", [True, False])
def test_naive_provider_matches_sdpa_in_float64(causal):
    q, k, v = (torch.randn(2, 3, 24, 8, dtype=torch.float64) for _ in range(3))
    call = bench.PROVIDERS["naive"](bench.Shape(2, 3, 24, 8, "fp32", causal), torch.device("cpu"))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(call(q, k, v), expected)


def test_naive_attention_cli_is_the_naive_preset(tmp_path):
    from torch_impl.bench import naive_attention

    out = tmp_path / "naive.jsonl"
    assert naive_attention.main([*CPU, "--seq-lens", "16", "--out", str(out), "--no-report"]) == 0
    records = read_records(out)
    assert {(r.implementation, r.mode) for r in records} == {
        (p, m) for p in ("naive", "naive_compiled") for m in ("forward", "backward")}
    for r in records:
        assert r.suite == "naive_attention" and r.batch_size == 8 and r.metrics["heads"] == 1
        assert r.metrics["causal"] is False and "memory_before_backward_bytes" in r.metrics
        assert r.flops_per_step == attention_flops(8, 1, 16, 16, False, r.mode)


def test_explicit_shapes_replace_the_grid(tmp_path):
    """--shapes BxHxNxd: one configuration per shape, with its own batch, heads and head dim (issue 14's sweep);
    mixing it with the grid's flags is a one-line error."""
    out = tmp_path / "shapes.jsonl"
    flags = ["--device", "cpu", "--dtypes", "fp32", "--warmup", "0", "--rep", "2", "--providers", "naive",
             "--passes", "forward", "--no-report", "--out", str(out)]
    assert bench.main([*flags, "--shapes", "2x3x16x24,1x2x8x80"]) == 0
    seen = {(r.batch_size, r.metrics["heads"], r.seq_len, r.metrics["head_dim"]) for r in read_records(out)}
    assert seen == {(2, 3, 16, 24), (1, 2, 8, 80)}
    with pytest.raises(SystemExit, match="--seq-lens and explicit shapes"):
        bench.main([*flags, "--shapes", "1x1x8x16", "--seq-lens", "8"])
    shapes = bench.shapes(bench.resolve_args(bench.build_parser().parse_args(["--preset", "flash_shapes"])))
    assert {(s.head_dim, s.batch, s.heads, s.seq_len) for s in shapes} >= {(80, 4, 32, 2048), (256, 1, 8, 8192)}

"""analysis.overlap on hand-made traces whose answers are worked out by hand."""

from __future__ import annotations

import gzip
import io
import json
import random
import tarfile

import pytest

from analysis.overlap import analyze, main, markdown, medians, merged, step_split, traces


def _kernel(name: str, start: float, dur: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": start, "dur": dur, "pid": 0, "tid": 7}


# compute: gemm [0, 10] alone, gemm [20, 30] and add [30, 35] beside the collective [18, 40]; a CPU op to ignore
EVENTS = [_kernel("gemm", 0, 10), _kernel("gemm", 20, 10), _kernel("add", 30, 5),
          _kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 18, 22),
          {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100, "pid": 1, "tid": 1}]


def test_times_by_hand():
    r = analyze(EVENTS, "t", steps=1)
    # span 0..40 us; compute [0,10] + [20,35] = 25; collective 22; both [20,35] = 15; idle 40 - (10 + 22) = 8
    assert (r.span_ms, r.compute_ms, r.comm_ms, r.both_ms, r.idle_ms) == pytest.approx(
        (0.040, 0.025, 0.022, 0.015, 0.008))
    gemm = next(k for k in r.kernels if k.name == "gemm")
    assert gemm.alone_us == (10.0,) and gemm.beside_us == (10.0,) and gemm.slowdown == pytest.approx(1.0)
    assert [k.name for k in r.kernels] == ["gemm", "add"]  # largest total first, no collective among them
    with_base = analyze(EVENTS, "t", steps=2, baseline={"gemm": 5.0})
    assert with_base.span_ms == pytest.approx(0.020)  # per step
    assert next(k for k in with_base.kernels if k.name == "gemm").slowdown == pytest.approx(2.0)


def test_a_trace_s_step_split_is_analyze_s_per_step(tmp_path):
    """``step_split`` (what the DDP benchmark's --profile puts in each rank's record) is ``analyze``'s split per
    step; a trace without kernels (a CPU run) has none."""
    path = tmp_path / "fsdp_rank0_trace.json"
    path.write_text(json.dumps({"traceEvents": EVENTS}))
    assert step_split(path, steps=2) == pytest.approx(
        {"span_ms": 0.020, "compute_ms": 0.0125, "comm_ms": 0.011, "both_ms": 0.0075, "idle_ms": 0.004})
    path.write_text(json.dumps({"traceEvents": EVENTS[-1:]}))
    assert step_split(path, steps=2) is None


def test_copies_between_gpus_are_communication():
    """The copy engines' communication (``Memcpy PtoP``) counts as a collective; a copy within one GPU is left out."""
    events = [_kernel("gemm", 0, 10), _kernel("gemm", 20, 10),
              {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy PtoP (Device -> Device)", "ts": 18, "dur": 22},
              {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 50, "dur": 5}]
    r = analyze(events, "t", steps=1)
    # span 0..40 us (the local copy is not counted); compute 20; the peer copy 22; both [20,30] = 10; idle 40 - 32
    assert (r.span_ms, r.compute_ms, r.comm_ms, r.both_ms, r.idle_ms) == pytest.approx(
        (0.040, 0.020, 0.022, 0.010, 0.008))
    assert [k.name for k in r.kernels] == ["gemm"]


def test_host_ops_by_inclusive_time_per_step():
    host = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "ts": 0, "dur": 500},  # left out
            {"ph": "X", "cat": "user_annotation", "name": "## Call CompiledFxGraph", "ts": 0, "dur": 60},
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 200, "dur": 40},
            {"ph": "X", "cat": "python_function", "name": "train_step", "ts": 0, "dur": 900}]  # not a host op
    r = analyze(EVENTS + host, "t", steps=2, host=2)
    # aten::mm twice (100 + 40 us over 2 steps), the compiled graph's range once (60 us)
    assert [n for n, _, _ in r.host_ops] == ["aten::mm", "## Call CompiledFxGraph"]
    assert [(ms, calls) for _, ms, calls in r.host_ops] == [pytest.approx((0.070, 1.0)), pytest.approx((0.030, 0.5))]
    assert analyze(EVENTS + host, "t", steps=2).host_ops == ()  # only when asked
    assert "| `aten::mm` | 0.07 | 1 |" in markdown([r])


def test_interval_union_matches_a_brute_force_count():
    rng = random.Random(5)
    intervals = [(s, s + rng.randint(1, 9)) for s in (rng.randint(0, 90) for _ in range(40))]
    covered = {t for a, b in intervals for t in range(a, b)}
    union = merged([(float(a), float(b)) for a, b in intervals])
    assert sum(b - a for a, b in union) == len(covered)
    assert all(union[i][1] < union[i + 1][0] for i in range(len(union) - 1))


@pytest.mark.parametrize("suffix, mode", [(".tgz", "w:gz"), (".tar.xz", "w:xz")])
def test_reads_gzipped_traces_in_an_archive(tmp_path, capsys, suffix, mode):
    archive = tmp_path / f"profiles{suffix}"
    with tarfile.open(archive, mode) as tar:
        for name, data in (("profiles/a_rank0_trace.json", json.dumps({"traceEvents": EVENTS}).encode()),
                           ("profiles/none_rank0_trace.json",
                            gzip.compress(json.dumps({"traceEvents": EVENTS[:1]}).encode())),
                           ("profiles/a_rank0_kernels.md", b"not a trace")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert [name for name, _ in traces(archive)] == ["a_rank0_trace.json", "none_rank0_trace.json"]
    assert medians(dict(traces(archive))["none_rank0_trace.json"], "none") == {"gemm": 10.0}
    assert main([str(archive), "--steps", "1", "--baseline", "none_rank0_trace.json"]) == 0
    out = capsys.readouterr().out
    assert "| a_rank0_trace.json | 0.0 |" in out and "| baseline us |" in out
    assert main([str(archive), "--steps", "1", "--baseline", f"{archive}:none_rank0_trace.json"]) == 0
    assert "| baseline us |" in capsys.readouterr().out


def test_bad_input_is_a_one_line_error(tmp_path, capsys):
    bad = tmp_path / "x_trace.json"
    bad.write_text("{not json")
    for argv in ([str(bad)], [str(tmp_path / "missing.json")], [str(bad), "--steps", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err and "Traceback" not in "\n".join(err)
    empty = tmp_path / "e_trace.json"
    empty.write_text(json.dumps({"traceEvents": EVENTS[-1:]}))
    with pytest.raises(SystemExit):
        main([str(empty)])
    assert "no kernel events" in capsys.readouterr().err

"""The DDP step benchmark: flag parsing, and real CPU runs (one plain process, then 2 gloo ranks under torchrun).

One module-scoped fixture runs ``--dist none`` as a plain ``python -m`` process and then every other impl in a
single torchrun launch of 2 ranks (tiny model, seq 32, 1 warm-up + 2 timed steps), into one JSON Lines file;
the tests check its records field by field, recomputing tokens/s and the scaling efficiency by hand.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from analysis.data_parallel import baseline_key
from analysis.records import read_records
from parallelism_calc.specs import MODELS
from tests._dist import free_port
from torch_impl.bench.ddp import (Config, configurations, main, parse_bucket_mb, parse_comm_dtypes, parse_comm_sms,
                                  parse_engines, parse_impls, parse_means, parse_optimizer_steps,
                                  predicted_memory)

REPO = Path(__file__).resolve().parent.parent
COMMON = ["--device", "cpu", "--model", "tiny", "--seq-len", "32", "--batch-size", "2", "--warmup", "1",
          "--steps", "2", "--timeout", "30"]
MULTI = "naive,flat,individual,bucketed,zero1,zero2,fsdp,torch_ddp,fsdp2"
ENV = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp") / "ddp.jsonl"
    _run([sys.executable, "-m", "torch_impl.bench.ddp", *COMMON, "--dist", "none", "--out", str(out)])
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
          "--master_port", str(free_port()), "-m", "torch_impl.bench.ddp", *COMMON, "--impl", MULTI,  # old flag name
          "--bucket-mb", "0.01,10", "--out", str(out)])
    return out, read_records(out)


def test_parse_flags():
    assert parse_impls("naive, bucketed,naive") == ["naive", "bucketed"]
    with pytest.raises(ValueError):
        parse_impls("naive,ddp3")
    assert parse_bucket_mb("1,10,25") == [1.0, 10.0, 25.0]
    for bad in ("0", "-1", "ten", ""):
        with pytest.raises(ValueError):
            parse_bucket_mb(bad)
    cfgs = configurations(["naive", "bucketed", "zero1", "torch_ddp"], [1.0, 25.0])
    assert [c.name for c in cfgs] == ["naive", "bucketed 1MB", "bucketed 25MB", "zero1 + bucketed 1MB",
                                      "zero1 + bucketed 25MB", "torch_ddp"]
    assert Config("bucketed", 0.5).name == "bucketed 0.5MB"
    # --comm-sms multiplies our wrappers' configurations, --comm-dtype those that send bf16 (torch_ddp too)
    cfgs = configurations(["naive", "bucketed", "torch_ddp"], [25.0], parse_comm_sms("0,8"),
                          parse_comm_dtypes("grad,bf16"))
    assert [c.name for c in cfgs] == ["naive", "naive, comm 8 SMs", "bucketed 25MB", "bucketed 25MB, comm 8 SMs",
                                      "bucketed 25MB, bf16 comm", "bucketed 25MB, comm 8 SMs, bf16 comm", "torch_ddp",
                                      "torch_ddp, bf16 comm"]
    for bad in ("-1", "x", ""):
        with pytest.raises(ValueError, match="--comm-sms"):
            parse_comm_sms(bad)
    with pytest.raises(ValueError, match="--comm-dtype"):
        parse_comm_dtypes("fp16")
    # --engine multiplies bucketed and zero2 only
    cfgs = configurations(["naive", "bucketed", "zero2"], [25.0], engines=parse_engines("nccl,copy_engines", "cuda"))
    assert [c.name for c in cfgs] == ["naive", "bucketed 25MB", "bucketed 25MB, copy engines", "zero2 25MB",
                                      "zero2 25MB, copy-engine gather"]
    with pytest.raises(ValueError, match="--engine copy_engines copies into the peers' GPU memory: CUDA devices only"):
        parse_engines("copy_engines", "cpu")
    with pytest.raises(ValueError, match="--engine"):
        parse_engines("ring", "cuda")
    # --optimizer-step multiplies individual and bucketed only
    cfgs = configurations(["naive", "individual", "bucketed"], [25.0],
                          optimizer_steps=parse_optimizer_steps("overlapped,after"))
    assert [c.name for c in cfgs] == ["naive", "individual", "individual, optimizer after", "bucketed 25MB",
                                      "bucketed 25MB, optimizer after"]
    with pytest.raises(ValueError, match="--optimizer-step"):
        parse_optimizer_steps("during")
    # --mean multiplies bucketed on the copy engines without a cast only
    cfgs = configurations(["bucketed", "zero2"], [25.0], comm_dtypes=("grad", "bf16"),
                          engines=("nccl", "copy_engines"), means=parse_means("bucket,optimizer"))
    assert [c.name for c in cfgs] == ["bucketed 25MB", "bucketed 25MB, copy engines",
                                      "bucketed 25MB, copy engines, mean in optimizer", "bucketed 25MB, bf16 comm",
                                      "bucketed 25MB, bf16 comm, copy engines", "zero2 25MB",
                                      "zero2 25MB, copy-engine gather", "zero2 25MB, bf16 comm",
                                      "zero2 25MB, bf16 comm, copy-engine gather"]
    with pytest.raises(ValueError, match="--mean"):
        parse_means("median")


def test_modes_refuse_what_they_cannot_send():
    """comm_sms is our wrappers', bf16 gradients bucketed / zero1 / torch DDP's, the copy engines bucketed / zero2's:
    the rest is a one-line error."""
    from torch_impl.parallelize import apply_data_parallel

    model = torch.nn.Linear(2, 2)
    for mode, kwargs, words in (("torch_ddp", {"comm_sms": 8}, "comm_sms=8 with torch_ddp"),
                                ("naive", {"comm_dtype": "bf16"}, "comm_dtype='bf16' with naive"),
                                ("bucketed", {"comm_dtype": "fp8"}, "accepted: grad, bf16"),
                                ("naive", {"engine": "copy_engines"}, "copy_engines with bucketed, zero2"),
                                ("bucketed", {"mean": "optimizer"}, "mean='optimizer' with bucketed, engine='nccl'"),
                                ("zero1", {"mean": "optimizer"}, "optimizer with bucketed on copy_engines"),
                                ("bucketed", {"mean": "everywhere"}, "accepted: bucket, optimizer")):
        with pytest.raises(ValueError, match=words):
            apply_data_parallel(model, mode, bucket_mb=25.0, adamw={"lr": 1e-3, "fused": False}, **kwargs)
    from torch_impl.distributed import DDPBucketed

    bf16 = torch.bfloat16
    for kwargs in ({"mean": "optimizer"}, {"mean": "optimizer", "engine": "copy_engines", "comm_dtype": bf16}):
        with pytest.raises(ValueError, match="accepted: bucket, optimizer .optimizer with engine='copy_engines' and no "
                                             "comm_dtype."):
            DDPBucketed(model, **kwargs)


def test_one_record_per_configuration(records):
    _, recs = records
    assert [r.implementation for r in recs] == [
        "none", "naive", "flat", "individual", "bucketed 0.01MB", "bucketed 10MB", "zero1 + bucketed 0.01MB",
        "zero1 + bucketed 10MB", "zero2 0.01MB", "zero2 10MB", "fsdp", "torch_ddp", "fsdp2"]
    assert recs[0].world_size == 1 and all(r.world_size == 2 for r in recs[1:])


@pytest.mark.parametrize("index", range(13))
def test_record_fields(records, index):
    _, recs = records
    r = recs[index]
    assert r.status == "ok", r.error
    assert (r.suite, r.backend, r.mode, r.dtype, r.model, r.batch_size, r.seq_len) == (
        "ddp", "torch", "train_step", "fp32", "tiny", 2, 32)
    assert (r.warmup_steps, r.timed_steps) == (1, 2)
    assert set(r.phases) == {"forward", "backward", "comm", "optimizer"}
    # tokens/s counts every rank's batch: world x batch x seq / median step.
    assert r.tokens_per_s == pytest.approx(r.world_size * 2 * 32 / (r.timing["median_ms"] / 1e3))
    m = r.metrics
    assert m["predicted_memory_bytes"] > 0
    assert len(m["per_rank_peak_memory_bytes"]) == r.world_size and r.peak_memory_bytes is None  # CPU
    assert len(m["per_rank_median_ms"]) == r.world_size
    # Each step's time is the slowest rank's: its median is >= every rank's own median.
    assert r.timing["median_ms"] >= max(x["step"] for x in m["per_rank_median_ms"]) - 1e-9
    assert m["comm_blocked_share"] == pytest.approx(r.phases["comm"]["median_ms"] / r.timing["median_ms"])
    if m["impl"] in ("none", "torch_ddp", "fsdp2"):
        assert r.phases["comm"]["max_ms"] < 1.0  # no wrapper to wait on (recorded ~0)
    # Where each rank ran (one node of 1 or 2 local ranks), and rank 0's loss at every step, warm-up included.
    assert [(p["node_rank"], p["local_rank"]) for p in m["placement"]] == [(0, i) for i in range(r.world_size)]
    assert len(m["losses"]) == 3 and (m["losses"][0], m["losses"][-1]) == (m["loss_first"], m["loss_last"])


def test_predicted_memory_follows_the_strategy(records):
    _, recs = records
    by_name = {r.implementation: r.metrics for r in recs}
    naive, bucketed, zero1, fsdp = (by_name[n]["predicted_memory_bytes"] for n in (
        "naive", "bucketed 10MB", "zero1 + bucketed 10MB", "fsdp"))
    assert by_name["naive"]["strategy"] == "ddp" and by_name["fsdp2"]["strategy"] == "fsdp"
    # fp32: the buckets hold every gradient (4 bytes a parameter); ZeRO-1 halves AdamW's m and v (8 bytes) over
    # 2 ranks; the peak falls at the same moment of the step in all three
    n_params = MODELS["tiny"].n_params()
    assert bucketed - naive == by_name["bucketed 10MB"]["predicted_memory"]["buckets"] == 4 * n_params
    assert bucketed - zero1 == 8 * n_params / 2
    # ZeRO-2 keeps its slice of the averaged gradient (fp32, the gradients' own dtype here, so the reduce-scatter
    # lands in it) instead of full buckets: 4 bytes a parameter over 2 ranks
    assert by_name["zero2 10MB"]["strategy"] == "zero2"
    assert by_name["zero2 10MB"]["predicted_memory"]["buckets"] == 4 * n_params / 2
    assert zero1 - by_name["zero2 10MB"]["predicted_memory_bytes"] == 4 * n_params - 4 * n_params / 2
    # sharded weights and gradients: less than ZeRO-1 before the gathered and reduce-scatter buffers (on tiny, whose
    # blocks are not much larger than its 512 x 64 LM head, those buffers outweigh what sharding saves)
    fsdp_terms = by_name["fsdp"]["predicted_memory"]
    assert fsdp - fsdp_terms["gathered"] - fsdp_terms["reduce_scatter"] < zero1
    # The gathered working set, by hand (tiny: D 64, F 176, V 512; fp32, 4 bytes): our FSDP gathers a block at a
    # time with 1 prefetched, the embedding and the LM head on their own (V D < a block's 4 D^2 + 3 D F + 2 D);
    # FSDP2 keeps its root (embedding, final norm, LM head) gathered and holds 2 blocks.
    block = 4 * 64 * 64 + 3 * 64 * 176 + 2 * 64
    ours, fsdp2 = by_name["fsdp"]["predicted_memory"], by_name["fsdp2"]["predicted_memory"]
    assert ours["gathered"] == 2 * block * 4
    assert fsdp2["gathered"] == (2 * 512 * 64 + 64 + 2 * block) * 4
    assert ours["cast_weights"] == fsdp2["cast_weights"] == 0
    # Reduce-scatter buffers (per_device_memory's pending_reduce_scatters): those in flight at the peak's moment, by
    # hand at most ours 3 units (k = 2 in flight and one launched) of the largest, a block, each with its input and
    # output piece (4 x (1 + 1 / 2) bytes a parameter); FSDP2's one, its input alone, the largest its root (2 V D + D).
    assert ours["reduce_scatter"] <= 3 * block * 4 * 1.5 and fsdp2["reduce_scatter"] <= (2 * 512 * 64 + 64) * 4
    assert ours["total"] - ours["gathered"] - ours["reduce_scatter"] == pytest.approx(
        fsdp2["total"] - fsdp2["gathered"] - fsdp2["reduce_scatter"])


def test_predicted_memory_in_bf16_gathers_bf16_without_weight_copies():
    # --dtype bf16: autocast over fp32 weights. Both FSDPs gather in bf16 (2 bytes) and free after each forward,
    # so no bf16 weight copy lives until backward; zero1 reads the fp32 weights, so every matmul weight keeps one.
    args = argparse.Namespace(dtype="bf16", attention="sdpa", batch_size=2, compile=False, device="cuda")
    tiny = MODELS["tiny"]  # D 64, F 176, V 512, 2 layers
    ours, fsdp2 = (predicted_memory(Config(impl), args, tiny, 32, 2) for impl in ("fsdp", "fsdp2"))
    assert (ours.gathered, ours.cast_weights) == (2 * (4 * 64 * 64 + 3 * 64 * 176 + 2 * 64) * 2, 0)
    assert (fsdp2.gathered, fsdp2.cast_weights) == (
        (2 * 512 * 64 + 64 + 2 * (4 * 64 * 64 + 3 * 64 * 176 + 2 * 64)) * 2, 0)
    zero1 = predicted_memory(Config("zero1", 10.0), args, tiny, 32, 2)
    assert (zero1.gathered, zero1.cast_weights) == (0, (2 * (4 * 64 * 64 + 3 * 64 * 176) + 64 * 512) * 2)


def test_predicted_fsdp_gathering_is_our_fsdp_default():
    """analysis.data_parallel.FSDP_GATHERING (stdlib, shared with analysis.fidelity) holds our FSDP's default
    unit, prefetch and reduce-scatters in flight as values: they must be the wrapper's own."""
    import inspect

    from analysis.data_parallel import FSDP_GATHERING
    from torch_impl.distributed.fsdp import DEFAULT_PREFETCH, FSDP, MAX_PENDING_REDUCE_SCATTERS

    unit = inspect.signature(FSDP).parameters["gather_unit"].default
    ours = FSDP_GATHERING["fsdp"]
    assert (ours["gather_unit"], ours["prefetch_layers"], ours["pending_reduce_scatters"]) == (
        unit, DEFAULT_PREFETCH[unit], MAX_PENDING_REDUCE_SCATTERS)


def test_one_rank_fsdp_holds_no_reduce_scatter():
    """On one device our FSDP lands each unit's gradient at once (nothing in flight after the backward, before
    ``finish_gradient_synchronization``), so ``fsdp_terms`` counts no reduce-scatter buffer there; on more devices,
    and for FSDP2, the gathering is ``FSDP_GATHERING``'s."""
    from analysis.data_parallel import FSDP_GATHERING, fsdp_terms
    from torch_impl.distributed.fsdp import FSDP
    from torch_impl.model import TransformerLM, cross_entropy

    torch.manual_seed(0)
    fsdp = FSDP(TransformerLM(MODELS["tiny"]))
    tokens = torch.randint(0, MODELS["tiny"].vocab_size, (2, 9))
    cross_entropy(fsdp(tokens[:, :-1]), tokens[:, 1:]).backward()
    assert fsdp._pending_grads == [] and any(p.grad is not None for p in fsdp.parameters())
    assert fsdp_terms("fsdp", 1)["pending_reduce_scatters"] is None
    assert fsdp_terms("fsdp", 2) == FSDP_GATHERING["fsdp"] and fsdp_terms("fsdp2", 1) == FSDP_GATHERING["fsdp2"]


def test_scaling_efficiency_against_the_single_process_record(records):
    _, recs = records
    single = recs[0].tokens_per_s
    assert "scaling_efficiency" not in recs[0].metrics
    for r in recs[1:]:
        assert r.metrics["single_tokens_per_s"] == pytest.approx(single)
        assert r.metrics["scaling_efficiency"] == pytest.approx(r.tokens_per_s / (2 * single))


def test_report_only_prints_the_table(records, capsys):
    out, _ = records
    assert main(["--report-only", str(out)]) == 0
    text = capsys.readouterr().out
    assert "scaling_efficiency" in text and "zero1 + bucketed 10MB" in text and "comm_median_ms" in text


def test_compiled_baseline_is_its_own_baseline(tmp_path, capsys):
    """``--compile`` compiles each block; its records say so and only a compiled ``none`` is their baseline."""
    out = tmp_path / "ddp.jsonl"
    assert main([*COMMON, "--dist", "none", "--compile", "--out", str(out)]) == 0
    assert main([*COMMON, "--dist", "none", "--out", str(out)]) == 0
    compiled, eager = read_records(out)
    assert compiled.metrics["compiled"] is True and eager.metrics["compiled"] is False
    assert baseline_key(compiled) != baseline_key(eager)
    with pytest.raises(SystemExit):
        main([*COMMON, "--dist", "none,fsdp", "--compile", "--cuda-graph", "blocks", "--out", str(out)])
    assert "--cuda-graph blocks with fsdp" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*COMMON, "--dist", "none,fsdp2", "--dtype", "bf16_mixed", "--out", str(out)])
    assert "--dtype bf16_mixed with fsdp2: they shard or cast the weights themselves" in capsys.readouterr().err
    for flags, message in ((["--cuda-graph", "blocks"], "it needs --compile"),
                           (["--cuda-graph", "blocks", "--compile"], "it needs --device cuda"),
                           (["--mean", "optimizer"], "--mean optimizer: the means move to the optimizer with")):
        with pytest.raises(SystemExit):
            main([*COMMON, "--dist", "none", *flags, "--out", str(out)])
        assert message in capsys.readouterr().err


def test_none_under_torchrun_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # refused before any process group is made
    with pytest.raises(SystemExit):
        main([*COMMON, "--dist", "none,naive", "--out", str(tmp_path / "x.jsonl")])


_FAILING = """
import os, sys
import torch_impl.bench.ddp as bench
measure = bench._measure
def failing(cfg, *args, **kwargs):  # rank 1 fails before the wrapper's broadcast, rank 0 waits in it
    if os.environ["RANK"] == "1" and cfg.impl == "flat":
        raise RuntimeError("injected failure on rank 1")
    return measure(cfg, *args, **kwargs)
bench._measure = failing
sys.exit(bench.main())
"""


def test_a_rank_failing_out_of_step_ends_the_run_within_the_timeout(tmp_path):
    script, out = tmp_path / "failing.py", tmp_path / "fail.jsonl"
    script.write_text(_FAILING)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(script), *COMMON[:-2], "--timeout", "5",
           "--dist", "naive,flat,bucketed", "--bucket-mb", "10", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    recs = read_records(out)
    assert [r.implementation for r in recs] == ["naive", "flat"]  # the run stopped at flat
    assert recs[0].status == "ok"
    assert recs[1].status == "error" and "collective failure" in recs[1].error


def test_reports_draw_the_ddp_suite(records, tmp_path):
    from analysis import reports

    out, _ = records
    written = reports.write_reports(out.parent, tmp_path)
    names = {p.name for p in written}
    assert {"ddp.md", "ddp_tokens.png", "index.md"} <= names
    text = (tmp_path / "ddp.md").read_text()
    assert "scaling_efficiency" in text and "![throughput](ddp_tokens.png)" in text


def test_a_profiled_run_splits_each_rank_s_step_where_its_trace_has_kernels(tmp_path, monkeypatch):
    """``--profile`` keeps each rank's trace, and each rank's ``analysis.overlap.step_split`` of it goes into the
    record as ``per_rank_profile_ms``: none on the CPU (no kernels); a split where the trace has one (here the split
    stood in for, as a CUDA trace would give)."""
    import torch_impl.bench.ddp as ddp

    out, profiles = tmp_path / "ddp.jsonl", tmp_path / "profiles"
    assert main([*COMMON, "--dist", "none", "--profile", str(profiles), "--out", str(out)]) == 0
    assert (profiles / "none_rank0_trace.json").exists()
    assert "per_rank_profile_ms" not in read_records(out)[0].metrics
    split = {"span_ms": 3.0, "compute_ms": 2.0, "comm_ms": 0.0, "both_ms": 0.0, "idle_ms": 1.0}
    monkeypatch.setattr(ddp, "step_split", lambda path, steps: split if Path(path).exists() else None)
    assert main([*COMMON, "--dist", "none", "--profile", str(profiles), "--profile-host", "off", "--out",
                 str(out)]) == 0  # the host's ops all the same where there is no CUDA
    assert read_records(out)[1].metrics["per_rank_profile_ms"] == [split]

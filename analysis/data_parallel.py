"""Records of the data-parallel benchmark (``torch_impl.bench.ddp``): scaling efficiency against the
single-process run of the same configuration, and the benchmark's table. Stdlib only, except the table
(pandas, imported when it is drawn), so the benchmark can import it on every rank.

Scaling efficiency = tokens/s on N ranks / (N x tokens/s of one process), for the same model, per-rank batch,
sequence length, dtype, attention and device; 1.0 is perfect weak scaling.
"""

from __future__ import annotations

from analysis.records import STEP_PHASES as PHASES, Record, read_records

SUITE = "ddp"
# The working set each FSDP implementation of the benchmark gathers and reduce-scatters, as
# ``parallelism_calc.memory.per_device_memory`` takes it: ours a block's weights at a time (the embedding and the LM
# head units of their own, resharded) with torch_impl.distributed.fsdp's default prefetch for blocks,
# DEFAULT_PREFETCH["block"] = 1, and MAX_PENDING_REDUCE_SCATTERS = 2 in flight (tests/test_ddp_bench.py ties them),
# each keeping its output piece until it lands ("kept"), FSDP2 a block at a time with its root kept and one
# reduce-scatter in flight, its output cast into the sharded gradient at launch ("landed"; notes/fidelity.md, session
# 42 (helper)); both gather the embedding in the compute dtype (the residual stream runs in it). The peak placed in
# the step, as for one process. The benchmark records its prediction with it (torch_impl.bench.ddp.predicted_memory)
# and analysis.fidelity recomputes it.
FSDP_GATHERING = {"fsdp": dict(gather_unit="block", prefetch_layers=1, pending_reduce_scatters=2,
                               compute_dtype_stream=True, peak_model="timeline"),
                  "fsdp2": dict(gather_unit="block", prefetch_layers=1, reshard_root=False, pending_reduce_scatters=1,
                                reduce_scatter_output="landed", compute_dtype_stream=True, peak_model="timeline")}
LEADERBOARD_SUITE = "leaderboard"  # torch_impl.bench.leaderboard's records: a step sharded by our FSDP or FSDP2


def sharded_step_memory(spec, dist: str, n_devices: int, batch_tokens: int, seq_len: int, precision: str,
                        attention: str, checkpoint_every: int | None, nested_checkpoint: bool, loss: str,
                        kept_attention: bool, device_type: str = "cuda"):
    """The calculator's per-device peak (``per_device_memory``, a ``MemoryBreakdown``) of a training step sharded by
    our FSDP or FSDP2 (``dist``, its gathering: ``FSDP_GATHERING``) on ``device_type`` (``harness.device_terms``):
    what the leaderboard benchmark predicts and the fidelity report recomputes from its records."""
    from analysis.harness import device_terms
    from parallelism_calc.memory import per_device_memory

    return per_device_memory(spec, "fsdp", n_devices, batch_tokens, seq_len, precision, attention=attention,
                             checkpoint_every=checkpoint_every, nested_checkpoint=nested_checkpoint, loss=loss,
                             kept_attention=kept_attention, **device_terms(device_type),
                             **fsdp_terms(dist, n_devices))


def fsdp_terms(dist: str, n_devices: int) -> dict:
    """``FSDP_GATHERING[dist]`` on ``n_devices``: on one, our FSDP reduce-scatters nothing (``_reduce_scatter_grads``
    lands each unit's gradient in its shard at once, and that gradient is the calculator's ``grads``), so no
    reduce-scatter buffer is counted (lm8b's 4 blocks on one H200, eager: +23.6% -> +0.7%, notes/fidelity.md)."""
    return {**FSDP_GATHERING[dist], **({"pending_reduce_scatters": None} if dist == "fsdp" and n_devices == 1 else {})}


# torch DDP's bf16_compress_hook: the bf16 copy of every bucket beside its fp32 buckets (per_device_memory's
# gradient_buckets; torch.distributed.algorithms.ddp_comm_hooks.default_hooks.bf16_compress_hook).
BF16_HOOK_COPY_BYTES = 2
# The implementations that keep flat gradient buckets from step to step (the others reduce in place or shard;
# ZeRO-2 keeps slices of them, see memory_terms).
BUCKETED_IMPLS = ("bucketed", "zero1", "torch_ddp")


def calculator_strategy(impl: str) -> str:
    """What ``parallelism_calc`` calls a data-parallel implementation (``parallelism_calc.memory.STRATEGIES``): ddp,
    zero1, zero2 or fsdp."""
    return impl if impl in ("zero1", "zero2") else "fsdp" if impl in ("fsdp", "fsdp2") else "ddp"


def memory_terms(impl: str, grad_bytes: int, comm_dtype: str = "grad", *, n_devices: int) -> dict:
    """What ``per_device_memory`` takes for an implementation of the benchmark on ``n_devices``, beside its strategy,
    all with the peak placed in the step (``"timeline"``, as for one process): the FSDPs' gathered working set,
    reduce-scatter buffers and compute-dtype residual stream (``fsdp_terms``); the others' persistent gradient
    buckets, in the dtype the gradients travel in (``grad_bytes``, 2 for our bf16 communication); torch DDP's bf16
    hook keeps its fp32 buckets and compresses each into a bf16 copy (``grad_bytes + BF16_HOOK_COPY_BYTES``);
    ZeRO-2 its slices (sharded): the fp32 averaged gradient and, unless that is what travels, the slice the
    reduce-scatter lands in. Against the 2-GPU records: notes/data_parallel.md, notes/fidelity.md."""
    if impl in FSDP_GATHERING:
        return fsdp_terms(impl, n_devices)
    if impl == "zero2":
        travels = 2 if comm_dtype == "bf16" else grad_bytes
        return {"peak_model": "timeline", "gradient_buckets": 4 + (0 if travels == 4 else travels)}
    if impl not in BUCKETED_IMPLS:
        return {"peak_model": "timeline", "gradient_buckets": 0}
    if comm_dtype != "bf16":
        return {"peak_model": "timeline", "gradient_buckets": grad_bytes}
    return {"peak_model": "timeline",
            "gradient_buckets": grad_bytes + BF16_HOOK_COPY_BYTES if impl == "torch_ddp" else 2}


def baseline_key(record: Record) -> tuple:
    """What a run and its single-process baseline share: model, batch, sequence, dtype, attention, compiled
    or not, CUDA graphs or not, device."""
    return (record.model, record.batch_size, record.seq_len, record.dtype, record.metrics.get("attention"),
            bool(record.metrics.get("compiled")), record.metrics.get("cuda_graph", "off"),
            record.provenance.get("device_name"))


def single_process_baselines(records: list[Record]) -> dict[tuple, float]:
    """tokens/s of the latest ok ``none`` (world size 1) record per ``baseline_key``."""
    out = {}
    for r in records:
        if r.suite == SUITE and r.implementation == "none" and r.world_size == 1 and r.status == "ok" \
                and r.tokens_per_s:
            out[baseline_key(r)] = r.tokens_per_s
    return out


def add_scaling_efficiency(record: Record, baselines: dict[tuple, float]) -> None:
    """metrics.scaling_efficiency = tokens_per_s / (world_size x the single-process tokens/s), if known."""
    single = baselines.get(baseline_key(record))
    if record.status != "ok" or not record.tokens_per_s or single is None or record.implementation == "none":
        return
    record.metrics["single_tokens_per_s"] = single
    record.metrics["scaling_efficiency"] = record.tokens_per_s / (record.world_size * single)


def report(path: str) -> str:
    """A Markdown table of the ddp records in ``path`` with the step, phase medians, tokens/s, memory
    (measured and predicted) and the scaling efficiency (recomputed against the file's ``none`` records)."""
    from analysis.tables import markdown_table, records_frame

    records = [r for r in read_records(path) if r.suite == SUITE]
    if not records:
        raise ValueError(f"{path}: no {SUITE!r} records")
    baselines = single_process_baselines(records)
    for r in records:
        add_scaling_efficiency(r, baselines)
    frame = records_frame(records)
    for column in ("metrics.scaling_efficiency", "metrics.comm_blocked_share", "metrics.predicted_memory_bytes",
                   "metrics.cuda_graph"):
        if column not in frame:
            frame[column] = None
    columns = ["implementation", "model", "world_size", "dtype", "metrics.compiled", "metrics.cuda_graph", "batch_size",
               "seq_len", "status", "median_ms",
               *[f"{p}_median_ms" for p in PHASES if f"{p}_median_ms" in frame], "tokens_per_s", "mfu",
               "peak_memory_bytes", "metrics.predicted_memory_bytes", "metrics.comm_blocked_share",
               "metrics.scaling_efficiency"]
    frame["metrics.cuda_graph"] = frame["metrics.cuda_graph"].fillna("off")  # records before the flag
    columns = [c for c in columns if c in frame]
    return markdown_table(frame, columns)


def write_ddp_report(path, out_dir) -> list:
    """``<stem>.md`` (the table) and ``<stem>_tokens.png`` (tokens/s against world size, one line per
    implementation, one panel per model and dtype) in ``out_dir``; the files written."""
    from pathlib import Path

    from analysis.plots import line_plot
    from analysis.tables import records_frame

    path, out_dir = Path(path), Path(out_dir)
    table = out_dir / f"{path.stem}.md"
    plot = out_dir / f"{path.stem}_tokens.png"
    frame = records_frame([r for r in read_records(path) if r.suite == SUITE and r.status == "ok"])
    written = []
    if not frame.empty:
        frame["panel"] = frame["model"] + " " + frame["dtype"]
        line_plot(frame, "world_size", "tokens_per_s", hue="implementation", col="panel", xlabel="ranks",
                  ylabel="tokens / s", title="data-parallel throughput", out=plot)
        written.append(plot)
    image = f"![throughput]({plot.name})\n\n" if written else ""
    table.write_text(f"# Data-parallel benchmark\n\n{image}{report(path)}\n")
    return [table, *written]

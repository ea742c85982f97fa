"""Kernel categories, a JAX trace's kernel table, and the e2e benchmark's profile, checkpointing and compile
flags on a tiny model."""

import gzip
import json

import pytest

from analysis.kernels import gpu_idle, hlo_kernel_details, kernel_table, markdown, trace_gpu_idle, trace_kernel_times
from analysis.records import read_records
from torch_impl.bench import e2e
from torch_impl.profiling import CATEGORIES, categorize

FLAGS = ["--model", "tiny", "--batch-size", "2", "--seq-len", "16", "--warmup", "1", "--steps", "2", "--device", "cpu"]


@pytest.mark.parametrize("name,category", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_kernel__5x_cublas",
     "matmul"),
    ("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn", "matmul"),
    ("aten::mm", "matmul"),
    ("_attn_fwd", "matmul"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>", "reduction-softmax"),
    ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", "reduction-softmax"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "elementwise"),
    ("aten::silu", "elementwise"),
    ("_rotate_back_kernel", "elementwise"),  # RoPE's passes (torch_impl.qkv_pack_triton)
    ("_pack_kernel", "elementwise"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "other"),
    # XLA's names (jax.profiler traces)
    ("loop_multiply_fusion_12", "elementwise"),
    ("input_reduce_fusion_3", "reduction-softmax"),
    ("gemm_fusion_dot_4", "matmul"),
    ("cudnn$fmha", "matmul"),
    ("dynamic-update-slice.7", "elementwise"),
])
def test_categorize(name, category):
    assert categorize(name) == category


def _meta(kind, pid, name, tid=None):
    return {"ph": "M", "pid": pid, "name": kind, "args": {"name": name}, **({} if tid is None else {"tid": tid})}


def test_jax_trace_kernel_table_counts_stream_kernels_once(tmp_path):
    """Only the GPU's stream threads count: the "XLA Ops" thread repeats the same time per HLO op, and host
    threads are not device time."""
    events = [_meta("process_name", 1, "/host:CPU"), _meta("process_name", 2, "/device:GPU:0"),
              _meta("thread_name", 2, "Stream #13(compute)", tid=13), _meta("thread_name", 2, "XLA Ops", tid=99),
              _meta("thread_name", 1, "python", tid=5)]
    kernels = [("gemm_fusion_dot", 3000.0), ("loop_add_fusion", 500.0), ("gemm_fusion_dot", 3000.0),
               ("input_reduce_fusion", 1500.0)]
    for i, (name, dur) in enumerate(kernels):
        events.append({"ph": "X", "pid": 2, "tid": 13, "ts": i * 1e4, "dur": dur, "name": name})
        events.append({"ph": "X", "pid": 2, "tid": 99, "ts": i * 1e4, "dur": dur, "name": name})  # the HLO op
        events.append({"ph": "X", "pid": 1, "tid": 5, "ts": i * 1e4, "dur": 7.0, "name": name})  # host
    path = tmp_path / "host.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    times = trace_kernel_times(path)
    assert times == {"gemm_fusion_dot": 6.0, "loop_add_fusion": 0.5, "input_reduce_fusion": 1.5}
    rows = {r.category: r for r in kernel_table(times, n_steps=2)}
    assert rows["matmul"].time_ms == pytest.approx(3.0) and rows["matmul"].fraction == pytest.approx(0.75)
    assert rows["reduction-softmax"].time_ms == pytest.approx(0.75) and rows["other"].time_ms == 0
    with gzip.open(path, "wt") as f:  # a CPU run's trace: no device timeline
        json.dump({"traceEvents": events[:1] + events[4:5]}, f)
    with pytest.raises(ValueError, match="no GPU stream timeline"):
        trace_kernel_times(path)


def test_a_trace_of_several_gpus_counts_its_first_gpu_s_kernels(tmp_path):
    """A program over a mesh traced in one process: each GPU runs the step's kernels, and one device's time is the
    step's (the first by number: GPU:2 before GPU:10); its idle time is that GPU's too."""
    events = []
    for pid, device, dur in ((3, "/device:GPU:10", 700.0), (2, "/device:GPU:2", 500.0), (4, "/device:GPU:11", 9.0)):
        events += [_meta("process_name", pid, device), _meta("thread_name", pid, "Stream #1", tid=1),
                   {"ph": "X", "pid": pid, "tid": 1, "ts": 0.0, "dur": dur, "name": "gemm_fusion_dot"},
                   {"ph": "X", "pid": pid, "tid": 1, "ts": 1000.0, "dur": dur, "name": "loop_add_fusion"}]
    path = tmp_path / "mesh.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert trace_kernel_times(path) == {"gemm_fusion_dot": 0.5, "loop_add_fusion": 0.5}
    assert trace_gpu_idle(path).idle_ms == pytest.approx(0.5)


def test_jax_trace_kernels_of_several_programs_keep_their_program(tmp_path):
    """The per-block step runs several XLA programs whose fusions share names: each kernel is keyed with its
    program (the event's ``hlo_module``), categorized by its own name, and described from that program's HLO."""
    events = [_meta("process_name", 2, "/device:GPU:0"), _meta("thread_name", 2, "Stream #13", tid=13)]
    kernels = [("loop_add_fusion", "jit_forward", 400.0), ("loop_add_fusion", "jit_backward", 900.0),
               ("loop_add_fusion", "jit_forward", 400.0), ("nvjet_tst_128x128", "jit_forward", 2000.0)]
    events += [{"ph": "X", "pid": 2, "tid": 13, "ts": i * 1e4, "dur": dur, "name": name,
                "args": {"hlo_module": module, "hlo_op": name}} for i, (name, module, dur) in enumerate(kernels)]
    path = tmp_path / "programs.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    times = trace_kernel_times(path)
    assert times == {"loop_add_fusion [jit_forward]": 0.8, "loop_add_fusion [jit_backward]": 0.9,
                     "nvjet_tst_128x128 [jit_forward]": 2.0}
    rows = {r.category: r for r in kernel_table(times, n_steps=1)}
    assert rows["elementwise"].time_ms == pytest.approx(1.7) and rows["matmul"].time_ms == pytest.approx(2.0)
    hlo = """HloModule jit_forward, entry_computation_layout={()->f32[]}
ENTRY %main {
  ROOT %loop_add_fusion = bf16[8,64]{1,0} fusion(%a), kind=kLoop, calls=%c, metadata={op_name="jit(forward)/add"}
}

HloModule jit_backward, entry_computation_layout={()->f32[]}
ENTRY %main {
  ROOT %loop_add_fusion = f32[64]{0} fusion(%b), kind=kLoop, calls=%d, metadata={op_name="jit(backward)/add"}
}"""
    details = hlo_kernel_details(hlo)
    assert details["loop_add_fusion [jit_forward]"] == "bf16[8,64] Loop ...jit(forward)/add"
    assert details["loop_add_fusion [jit_backward]"] == "f32[64] Loop ...jit(backward)/add"


def test_trace_gpu_idle_counts_overlaps_once_and_names_the_gaps(tmp_path):
    """Busy time is the union of the kernels' intervals over both streams; each gap names its neighbours."""
    events = [_meta("process_name", 2, "/device:GPU:0"), _meta("thread_name", 2, "Stream #13", tid=13),
              _meta("thread_name", 2, "Stream #14", tid=14)]
    kernels = [(13, "a", 0, 100), (14, "side", 50, 100), (13, "b", 120, 20), (13, "c", 400, 100),
               (14, "inner", 420, 10)]  # busy 0-150 and 400-500; gaps 150-400 (250 us) after b or side
    events += [{"ph": "X", "pid": 2, "tid": tid, "ts": ts, "dur": dur, "name": name}
               for tid, name, ts, dur in kernels]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    idle = trace_gpu_idle(path)
    assert idle.window_ms == pytest.approx(0.5) and idle.busy_ms == pytest.approx(0.25)
    assert idle.idle_ms == pytest.approx(0.25)
    assert idle.gaps == ((pytest.approx(0.25), "side", "c"),)
    assert "idle 0.125 ms per step" in idle.markdown(n_steps=2)


def test_gpu_idle_sums_the_gaps_per_pair_of_neighbours():
    """Three short gaps between a and b outweigh one longer gap between b and c; overlaps are not gaps."""
    kernels = [("a", 0, 10), ("b", 14, 10), ("a", 30, 10), ("b", 44, 10), ("c", 60, 10), ("a", 70, 10),
               ("b", 84, 10), ("side", 85, 5)]
    idle = gpu_idle(kernels, largest=2)
    assert idle.idle_ms == pytest.approx(0.024) and idle.busy_ms == pytest.approx(0.070)
    assert idle.pairs == ((pytest.approx(0.012), 3, "a", "b"), (pytest.approx(0.006), 1, "b", "c"))
    assert idle.gaps == ((pytest.approx(0.006), "b", "c"), (pytest.approx(0.006), "b", "a"))
    assert "| 0.006 | 1.5 | `a` | `b` |" in idle.markdown(n_steps=2)
    with pytest.raises(ValueError, match="no kernels"):
        gpu_idle([])


def test_kernel_intervals_keep_the_device_kernels_alone():
    """torch.profiler's events -> ``gpu_idle``'s kernels: host ops and annotations drawn on the device left out."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    from torch_impl.profiling import kernel_intervals

    def event(name, start, end, device_type=DeviceType.CUDA, annotation=False):
        return FunctionEvent(id=0, name=name, thread=0, start_us=start, end_us=end, use_device="cuda",
                             device_type=device_type, is_user_annotation=annotation)

    class Prof:
        def events(self):
            return [event("aten::mm", 0, 50, DeviceType.CPU), event("gemm", 10, 30),
                    event("step#1", 0, 90, annotation=True), event("silu", 34, 40)]

    assert kernel_intervals(Prof()) == [("gemm", 10, 20), ("silu", 34, 6)]
    assert gpu_idle(kernel_intervals(Prof())).idle_ms == pytest.approx(0.004)


def test_hlo_kernel_details_name_kernels_as_traces_do():
    hlo = """ENTRY %main {
  %loop_add_fusion.7 = f32[48,1600,6400]{2,1,0} fusion(f32[48,1600,6400]{2,1,0} %a), kind=kLoop, calls=%c, \
metadata={op_name="jit(train_step)/mul" stack_frame_id=3}
  ROOT %custom-call.2 = (bf16[8,64]{1,0}, s8[0]{0}) custom-call(%b), custom_call_target="__cublas$gemm"
}"""
    details = hlo_kernel_details(hlo)
    assert details["loop_add_fusion_7"] == "f32[48,1600,6400] Loop ...jit(train_step)/mul"
    assert details["custom_call_2"] == "(bf16[8,64], s8[0])"
    rows = kernel_table({"loop_add_fusion_7": 3.0}, n_steps=1)
    assert "| f32[48,1600,6400] Loop ...jit(train_step)/mul |" in markdown(rows, "t", details)


def test_e2e_profile_checkpoint_and_fused_flags(tmp_path):
    out, prof = tmp_path / "runs.jsonl", tmp_path / "prof"
    assert e2e.main([*FLAGS, "--ac-every", "1", "--fused-adamw", "off", "--profile", str(prof),
                     "--out", str(out)]) == 0
    record, = read_records(out)
    assert record.implementation == "eager naive, ckpt 1" and record.metrics["fused_adamw"] is False
    shares = [record.metrics[f"time_share.{c}"] for c in CATEGORIES]
    assert sum(shares) == pytest.approx(1.0) and record.metrics["time_share.matmul"] > 0
    trace = json.loads((prof / "tiny_2x16_train_step_fp32_trace.json").read_text())
    assert trace["traceEvents"]
    assert "| matmul |" in (prof / "tiny_2x16_train_step_fp32_kernels.md").read_text()
    with pytest.raises(SystemExit, match="needs --ac-every"):
        e2e.main([*FLAGS, "--nested-checkpoint"])


def test_records_carry_the_predicted_activation_memory(tmp_path):
    from parallelism_calc.memory import activation_bytes_per_token
    from parallelism_calc.specs import MODELS

    out = tmp_path / "runs.jsonl"
    long = ["--seq-len", "64"]
    for extra in ([], ["--mode", "forward"], ["--ac-every", "2"], long, [*long, "--attention", "sdpa"]):
        assert e2e.main([*FLAGS, *extra, "--out", str(out)]) == 0
    records = read_records(out)
    plain, forward, segments, naive64, sdpa64 = (r.metrics["predicted_activation_bytes"] for r in records)
    tiny = MODELS["tiny"]
    cpu = {"fused_norm": False}  # a CPU run: RMSNorm written out (analysis.harness.device_terms)
    assert plain == activation_bytes_per_token(tiny, 16, "fp32", "none", "naive", **cpu).total_bytes * 2 * 16
    assert forward is None  # nothing saved for backward
    # tiny has 2 blocks: one segment of 2 keeps its input and both blocks' activations while recomputed.
    a = activation_bytes_per_token(tiny, 16, "fp32", "full", "naive", **cpu).per_layer_bytes
    assert segments == plain + a * 2 * 16
    assert 0 < sdpa64 < naive64  # at 64 tokens the n x n probabilities outweigh a fused kernel's extra O
    # The train step's predicted peak is placed in the step (peak_model="timeline"): weights and AdamW state
    # (12 B/param in fp32) plus the larger of the activations with the plain loss's two fp32 N x V gradients at the
    # loss's backward and the gradients (4 B/param) at the backward's end (no autocast copies in fp32; the
    # backward's moments in between lie below both here).
    loss_backward = 2 * 16 * tiny.vocab_size * 8
    assert records[0].metrics["predicted_peak_bytes"] == 12 * tiny.n_params() + max(plain + loss_backward,
                                                                                    4 * tiny.n_params())
    assert records[1].metrics["predicted_peak_bytes"] is None


def test_attention_parts_records_each_pass_with_its_flops(tmp_path):
    """``python -m torch_impl.bench.attention_parts``: a record per pass, each kernel category's time per call and
    the matmuls' and softmax's FLOPs at one layer's shapes (tiny: 4 heads of 16)."""
    from analysis.records import read_records
    from torch_impl.bench import attention_parts

    out = tmp_path / "parts.jsonl"
    assert attention_parts.main(["--model", "tiny", "--batch-size", "2", "--seq-len", "8", "--calls", "1",
                                 "--device", "cpu", "--out", str(out)]) == 0
    forward, both = read_records(out)
    assert (forward.mode, both.mode) == ("forward", "forward_backward")
    entries = 2 * 4 * 8 * 8
    assert forward.metrics["matmul_flops"] == 4 * entries * 16 and both.metrics["matmul_flops"] == 12 * entries * 16
    assert forward.metrics["softmax_flops"] == 5 * entries and both.metrics["softmax_flops"] == 9 * entries
    assert forward.metrics["matmul_ms"] > 0


def test_profile_steps_without_the_host_records_the_gpu_alone(monkeypatch):
    """``host=False`` hands the profiler CUDA activity alone where there is CUDA (the profiler's per-op host cost
    left out), and the host's where there is not (nothing else to record)."""
    import torch_impl.profiling as profiling

    asked = []

    class FakeProfile:
        def __init__(self, activities):
            asked.append(activities)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(profiling, "profile", FakeProfile)
    monkeypatch.setattr(profiling, "kernel_table", lambda prof, n, calls=None: [])
    monkeypatch.setattr(profiling.torch.cuda, "synchronize", lambda: None)
    for cuda in (True, False):
        monkeypatch.setattr(profiling.torch.cuda, "is_available", lambda cuda=cuda: cuda)
        for host in (True, False):
            profiling.profile_steps(lambda: None, 1, None, "t", host=host)
    cpu, gpu = profiling.ProfilerActivity.CPU, profiling.ProfilerActivity.CUDA
    assert asked == [[cpu, gpu], [gpu], [cpu], [cpu]]

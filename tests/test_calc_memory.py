"""Memory formulas (parallelism_calc.memory) against hand calculations and against the real PyTorch model.

The hand calculations are written out here independently of the module's helpers. The activation
accounting is checked against what ``torch_impl.model.TransformerLM`` really saves for backward, measured
with ``torch.autograd.graph.saved_tensors_hooks`` (unique storages, parameters excluded).
"""

import contextlib
import math

import pytest

from parallelism_calc.memory import (
    PRECISIONS,
    ActivationBreakdown,
    Precision,
    activation_bytes_per_token,
    devices_needed,
    fsdp_half_activation_bytes,
    handout_activation_bytes_per_token,
    min_fsdp_degree,
    per_device_memory,
    state_bytes,
    state_bytes_per_param,
)
from parallelism_calc.specs import MODELS, ModelSpec, ParallelSpec

XXL = MODELS["xxl"]
TINY = MODELS["tiny"]  # D 64, F 176, H 4, 2 layers, V 512
# A toy transformer for exact per-device numbers: D 8, F 16, H 2, 2 layers, V 10.
TOY = ModelSpec("toy", vocab_size=10, context_length=16, d_model=8, d_ff=16, n_layers=2, n_heads=2)
TOY_PARAMS = 10 * 8 + 2 * (4 * 8 * 8 + 3 * 8 * 16 + 2 * 8) + 8 + 8 * 10  # 1,448


# ----------------------------------------------------------------------------------------------- precision


def test_precision_presets_and_16_bytes_of_state():
    assert {name: (p.param_bytes, p.grad_bytes, p.master_bytes, p.optimizer_bytes, p.activation_bytes)
            for name, p in PRECISIONS.items()} == {
        "fp32": (4, 4, 0, 8, 4), "bf16_autocast": (4, 4, 0, 8, 2), "bf16_mixed": (2, 2, 4, 8, 2)}
    for name in PRECISIONS:
        assert state_bytes_per_param(name) == 16
    assert state_bytes_per_param(Precision("x", 2, 2, 0, 4, 2)) == 8
    assert not PRECISIONS["fp32"].autocast and PRECISIONS["bf16_autocast"].autocast
    assert not PRECISIONS["bf16_mixed"].autocast


# ----------------------------------------------------------------------------------------------- XXL


def test_xxl_state_activations_and_device_count():
    assert XXL.n_params() == 219_848_638_464
    assert state_bytes(XXL) == 219_848_638_464 * 16 == 3_517_578_215_424
    assert handout_activation_bytes_per_token(XXL) == 126 * (16_384 + 53_248) * 2 == 17_547_264
    assert devices_needed(3_517_578_215_424, 80e9) == 44  # 43.97 devices of 80 GB
    assert devices_needed(160e9, 80e9) == 2
    # (16 P + A/2) / N + A/2 for one sequence of 1,024 tokens on 64 devices, written out.
    a = 1024 * 17_547_264
    assert fsdp_half_activation_bytes(XXL, 1024, 64) == pytest.approx((3_517_578_215_424 + a / 2) / 64 + a / 2)


def test_min_fsdp_degree_small_case_by_hand():
    # FFN-only, D 2, F 6, one block: P = 2*2*6 = 24, state 16 P = 384 bytes; activations (2 + 6) * 2 = 16
    # bytes per token; 10 tokens: A = 160, A/2 = 80. Per device: (384 + 80) / N + 80 = 464 / N + 80.
    spec = ModelSpec("mini", vocab_size=0, context_length=0, d_model=2, d_ff=6, n_layers=1, n_heads=0,
                     arch="ffn_only")
    assert fsdp_half_activation_bytes(spec, 10, 4) == 464 / 4 + 80
    assert min_fsdp_degree(spec, 10, 200) == 4  # 464/3 + 80 = 234.7 > 200; 464/4 + 80 = 196 <= 200
    assert min_fsdp_degree(spec, 10, 138) == 8  # 464/8 + 80 = 138 exactly: fits (<=)
    assert min_fsdp_degree(spec, 10, 10_000) == 1
    assert min_fsdp_degree(spec, 10, 81) == 464  # 464 / N <= 1
    assert min_fsdp_degree(spec, 10, 80) is None  # A/2 alone fills the budget: no N fits
    # XXL at 80 GB with one 1,024-token sequence, by hand: ceil((16 P + A/2) / (80e9 - A/2)).
    a = 1024 * 17_547_264
    assert min_fsdp_degree(XXL, 1024, 80e9) == math.ceil((3_517_578_215_424 + a / 2) / (80e9 - a / 2))


# ----------------------------------------------------------------------------------------------- activations


def hand_transformer_per_token(D, F, H, V, L, T, p, autocast=False, fused_norm=True):
    """Our model's saved bytes per token, fp32 norms and naive attention, written out term by term."""
    norm = 4 * D + 4 + (0 if fused_norm else 4 * D)  # fp32 input, fp32 rsqrt (written out: fp32 normalized too)
    norm_outs = (1 + 2) * D * p if autocast else 2 * D * p  # per product under autocast (q, k, v one), else shared
    probs = H * T * ((4 + p) if autocast else p)
    layer = 2 * norm + norm_outs + 4 * D * p + 4 * F * p + probs
    final = norm + D * p
    return L * layer + final + 4 * V + 8


def test_transformer_activations_by_hand():
    got = activation_bytes_per_token(TINY, 32, "fp32", attention="naive")
    assert isinstance(got, ActivationBreakdown)
    assert got.total_bytes == hand_transformer_per_token(64, 176, 4, 512, 2, 32, 4) == 13_340
    written_out = activation_bytes_per_token(TINY, 32, "fp32", attention="naive", fused_norm=False)
    assert written_out.total_bytes == hand_transformer_per_token(64, 176, 4, 512, 2, 32, 4, fused_norm=False) == 14_620
    assert written_out.total_bytes - got.total_bytes == (2 * 2 + 1) * 64 * 4  # x / rms of 2 L + 1 norms
    assert got.total_bytes == got.n_layers * got.per_layer_bytes + got.extra_bytes + got.recompute_bytes
    assert sum(v for k, v in got.terms.items() if k.startswith("layer.")) == got.per_layer_bytes
    assert got.terms["layer.attn_probs"] == 4 * 32 * 4 and got.terms["extra.loss_log_softmax"] == 512 * 4
    auto = activation_bytes_per_token(MODELS["small"], 1024, "bf16_autocast")
    assert auto.total_bytes == hand_transformer_per_token(768, 3072, 12, 10_000, 12, 1024, 2, autocast=True)
    mixed = activation_bytes_per_token(MODELS["small"], 1024, "bf16_mixed")
    assert mixed.total_bytes == hand_transformer_per_token(768, 3072, 12, 10_000, 12, 1024, 2)
    # flash: no probabilities, an fp32 LSE per head (its output O is output_proj's input, counted already).
    flash = activation_bytes_per_token(TINY, 32, "fp32", attention="flash")
    assert got.total_bytes - flash.total_bytes == 2 * (4 * 32 * 4 - 4 * 4)


def test_checkpointing_full_below_selective_below_none():
    spec, t = MODELS["small"], 4096
    none = activation_bytes_per_token(spec, t, "bf16_mixed", "none", "naive").total_bytes
    selective = activation_bytes_per_token(spec, t, "bf16_mixed", "selective", "naive").total_bytes
    full = activation_bytes_per_token(spec, t, "bf16_mixed", "full", "naive").total_bytes
    assert full < selective < none
    assert none - selective == 12 * 12 * 4096 * 2  # L H T p: the probabilities
    D, F, H, V = 768, 3072, 12, 10_000
    layer = 2 * (4 * D + 4) + 2 * D * 2 + 4 * D * 2 + 4 * F * 2 + H * t * 2
    extras = 4 * D + 4 + D * 2 + 4 * V + 8
    assert none == 12 * layer + extras
    assert full == 12 * D * 2 + layer + extras  # block inputs (bf16 stream) + one block recomputed + extras


def test_tensor_parallel_divides_the_right_terms():
    D, F, H, T, p = 64, 176, 4, 32, 4
    one = activation_bytes_per_token(TINY, T, "fp32", tp=1)
    two = activation_bytes_per_token(TINY, T, "fp32", tp=2)
    # q, k, v, attention output (4 D), SwiGLU (4 F) and the probabilities (H T) halve; norms and extras stay.
    assert one.per_layer_bytes - two.per_layer_bytes == (4 * D * p + 4 * F * p + H * T * p) // 2
    assert one.extra_bytes == two.extra_bytes
    for term in ("layer.norm_inputs", "layer.norm_outputs", "layer.norm_rsqrt"):
        assert one.terms[term] == two.terms[term]
    ffn_one = activation_bytes_per_token(XXL, 1, "bf16_mixed", tp=1)
    ffn_four = activation_bytes_per_token(XXL, 1, "bf16_mixed", tp=4)
    assert ffn_one.per_layer_bytes - ffn_four.per_layer_bytes == 53_248 * 2 * 3 // 4
    with pytest.raises(ValueError, match="must divide n_heads"):
        activation_bytes_per_token(TINY, 32, tp=3)


def test_ffn_only_checkpointing():
    assert activation_bytes_per_token(XXL, 1, "bf16_mixed", "selective").total_bytes == 17_547_264
    full = activation_bytes_per_token(XXL, 1, "bf16_mixed", "full")
    assert full.total_bytes == 126 * 16_384 * 2 + (16_384 + 53_248) * 2


# ----------------------------------------------------------------------------------------------- per device


def test_zero_stages_exact_on_toy_spec_and_ordering():
    # fp32: 4 + 4 + 0 + 8 per parameter; 4 devices; 64 tokens (4 sequences of 16) -> 16 tokens per device.
    P, N, tokens, T = TOY_PARAMS, 4, 64, 16
    act = hand_transformer_per_token(8, 16, 2, 10, 2, T, 4) * (tokens // N)
    unit = max(4 * 64 + 3 * 128 + 16, 10 * 8)  # a block (656 params) vs the embedding (80)
    expected = {
        "ddp": P * 16 + act,
        "zero1": P * 4 + P * 4 + P * 8 / N + act,
        "zero2": P * 4 + P * 4 / N + P * 8 / N + act,
        "zero3": P * 16 / N + act + 2 * unit * 4,
    }
    got = {s: per_device_memory(TOY, s, N, tokens, T, "fp32") for s in ("ddp", "zero1", "zero2", "zero3")}
    for strategy, total in expected.items():
        assert got[strategy].total == pytest.approx(total), strategy
        assert got[strategy].activations == act
    assert got["ddp"].total >= got["zero1"].total >= got["zero2"].total
    fsdp = per_device_memory(TOY, "fsdp", N, tokens, T, "fp32")
    assert fsdp.total == got["zero3"].total  # FSDP is ZeRO-3's accounting
    # A real-sized model, where activations are small against state: strict ordering down to zero3.
    big = [per_device_memory(MODELS["xl"], s, 8, 8 * 1024, 1024, "bf16_mixed", "full", "flash").total
           for s in ("ddp", "zero1", "zero2", "zero3")]
    assert big == sorted(big, reverse=True) and len(set(big)) == 4
    # bf16_mixed ZeRO-1: bf16 params and grads replicated, fp32 master + m + v sharded.
    z1 = per_device_memory(TOY, "zero1", N, tokens, T, "bf16_mixed")
    assert (z1.params, z1.grads, z1.master, z1.optimizer) == (P * 2, P * 2, P * 4 / N, P * 8 / N)


def test_fsdp_tp_and_autocast_weight_copies():
    mesh = ParallelSpec(dp=2, fsdp=2, tp=2)
    got = per_device_memory(TINY, "fsdp_tp", mesh, batch_tokens=8 * 32, seq_len=32, precision="bf16_autocast",
                            prefetch_layers=0)
    P = TINY.n_params()
    G = (2 * 2 + 1) * 64  # tiny's norm gains (2 blocks x 2 + the final one, 64 each): no TP dim, over fsdp only
    per_param = (P - G) / 4 + G / 2
    assert got.params == per_param * 4 and got.grads == per_param * 4 and got.optimizer == per_param * 8
    # 256 tokens over dp x fsdp = 4 ranks: 64 tokens each, with the TP split.
    assert got.activations == 64 * activation_bytes_per_token(TINY, 32, "bf16_autocast", tp=2).total_bytes
    # Stage 3 gathers in the compute dtype (bf16, 2 bytes): the largest of a block and the 512 x 64 table, / tp.
    assert got.gathered == max(4 * 64 * 64 + 3 * 64 * 176 + 2 * 64, 512 * 64) * 2 / 2
    # ...and frees the gathered bf16 weights after each forward: no autocast copies live until backward.
    assert got.cast_weights == 0
    assert got.total == pytest.approx(got.params + got.grads + got.master + got.optimizer + got.activations
                                      + got.gathered + got.cast_weights)
    # Without stage 3 the forward reads the fp32 weights: every matmul weight (all but the embedding and the
    # norm gains) keeps a bf16 copy for backward, whatever the sharding of the optimizer state or gradients.
    matmul = 2 * (4 * 64 * 64 + 3 * 64 * 176) + 64 * 512
    for strategy in ("ddp", "zero1", "zero2"):
        other = per_device_memory(TINY, strategy, 4, 8 * 32, 32, "bf16_autocast")
        assert (other.cast_weights, other.gathered) == (matmul * 2, 0), strategy
        assert other.formulas["cast_weights"] == "P_matmul * 2 / tp" and other.formulas["gathered"] == "0"
    assert per_device_memory(TINY, "zero2", 4, 8 * 32, 32, "fp32").cast_weights == 0  # no autocast, no copies


def test_stage3_gather_units_by_hand():
    # TINY: D 64, F 176, V 512, 2 layers; 4 devices; 8 sequences of 32 tokens.
    D, F, V = 64, 176, 512
    block = 4 * D * D + 3 * D * F + 2 * D  # 50,304: q, k, v, o, W1, W2, W3 and the two norm gains
    root = V * D + D + D * V  # 65,600: embedding, final norm gain, LM head

    def mem(precision="bf16_autocast", **kw):
        return per_device_memory(TINY, "fsdp", 4, 8 * 32, 32, precision, **kw)

    # Our FSDP(gather_unit="layer"): every weight matrix its own unit, 2 prefetched; the largest is the 512 x 64
    # embedding / LM head.
    ours = mem(gather_unit="layer", prefetch_layers=2)
    assert ours.gathered == 3 * 32_768 * 2 == 196_608 and ours.cast_weights == 0
    assert ours.formulas["gathered"] == "((1 + 2) * largest unit [layer]) * 2 / tp"
    assert mem("fp32", gather_unit="layer", prefetch_layers=2).gathered == 3 * 32_768 * 4
    # FSDP2 fully_shard per block + the root: the root (embedding, norm, LM head) stays gathered; 2 blocks.
    fsdp2 = mem(gather_unit="block", prefetch_layers=1, reshard_root=False)
    assert fsdp2.gathered == (root + 2 * block) * 2 == 332_416
    assert fsdp2.formulas["gathered"] == "(root + (1 + 1) * largest unit [block]) * 2 / tp"
    # The default (block units, the table a unit of its own, resharded): 2 x the block, the larger here.
    assert mem().gathered == 2 * max(block, V * D) * 2 == 201_216
    # The rest of the breakdown does not depend on how the working set is gathered.
    assert ours.total - ours.gathered == pytest.approx(fsdp2.total - fsdp2.gathered)
    # A model whose block matrix beats its vocabulary table: TOY (D 8, F 16, V 10) in fp32.
    toy = per_device_memory(TOY, "zero3", 4, 64, 16, "fp32", gather_unit="layer", prefetch_layers=2)
    assert toy.gathered == 3 * (8 * 16) * 4
    toy_root = per_device_memory(TOY, "zero3", 4, 64, 16, "fp32", gather_unit="layer", reshard_root=False)
    assert toy_root.gathered == (10 * 8 + 8 + 8 * 10 + 2 * 8 * 16) * 4
    # FFN-only: a block is W1 + W2 (2 D F), a layer one of them (D F); no root, whatever reshard_root says.
    ffn = dict(n_devices=64, batch_tokens=64 * 16, seq_len=16, precision="bf16_mixed", prefetch_layers=1)
    assert per_device_memory(XXL, "zero3", **ffn).gathered == 2 * 2 * 16_384 * 53_248 * 2
    assert per_device_memory(XXL, "zero3", gather_unit="layer", reshard_root=False, **ffn).gathered == \
        2 * 16_384 * 53_248 * 2
    # Not stage 3: nothing gathered, whatever the unit.
    assert per_device_memory(TINY, "zero2", 4, 8 * 32, 32, gather_unit="layer", prefetch_layers=2).gathered == 0


def test_errors_are_one_line_and_name_accepted_values():
    cases = [
        (lambda: per_device_memory(TOY, "zero4", 2, 64, 16), "accepted: ddp"),
        (lambda: per_device_memory(TOY, "fsdp_tp", 2, 64, 16), "needs a ParallelSpec"),
        (lambda: per_device_memory(TOY, "zero3", ParallelSpec(fsdp=2, tp=2), 64, 16), "fsdp_tp"),
        (lambda: per_device_memory(TOY, "ddp", 3, 64, 16), "not divisible"),
        (lambda: per_device_memory(TOY, "ddp", 0, 64, 16), ">= 1"),
        (lambda: per_device_memory(TOY, "fsdp", 2, 64, 16, gather_unit="param"), "accepted: block, layer"),
        (lambda: activation_bytes_per_token(TOY, 16, "fp16"), "accepted: fp32"),
        (lambda: activation_bytes_per_token(TOY, 16, checkpointing="some"), "accepted: none"),
        (lambda: activation_bytes_per_token(TOY, 16, attention="ring"), "accepted: naive"),
        (lambda: activation_bytes_per_token(XXL, 1, tp=5), "must divide d_ff"),
        (lambda: handout_activation_bytes_per_token(TINY), "ffn_only"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            call()
        assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------------------------- real model


# The CPU's F.rms_norm is the formula written out, which keeps x / rms too (CUDA's fused kernel does not).
CPU_NORM = {"fused_norm": False}


def measure_saved_bytes(spec, batch, seq, attention="naive", mode="fp32", device="cpu", compiled=False):
    """Bytes of unique non-parameter storages saved for backward by one forward + loss of our model (``compiled``:
    each block compiled, as ``torch_impl.parallelize.apply_compile`` does; compiled once before measuring)."""
    torch = pytest.importorskip("torch")
    from torch_impl.model import TransformerLM, cross_entropy

    torch.manual_seed(0)
    model = TransformerLM(spec, attention=attention, device=device,
                          dtype=torch.bfloat16 if mode == "bf16" else torch.float32)
    tokens = torch.randint(0, spec.vocab_size, (batch, seq), device=device)
    if compiled:
        from torch_impl.parallelize import apply_compile

        apply_compile(model, blocks_per_graph=1)
        with torch.autocast(device, dtype=torch.bfloat16) if mode == "autocast" else contextlib.nullcontext():
            cross_entropy(model(tokens), tokens).backward()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    autocast = torch.autocast(device, dtype=torch.bfloat16) if mode == "autocast" else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        cross_entropy(model(tokens), tokens)
    return sum(saved.values())


def batch_independent_bytes(spec, seq, attention, mode="fp32"):
    """Tensors our model saves once per forward whatever the batch (deliberately not in the accounting)."""
    rope = 2 * spec.context_length * (spec.d_head // 2) * 4  # slices of the one fp32 cos and sin table
    mask = spec.n_layers * seq * seq if attention == "naive" else 0  # (T, T) bool causal mask
    # A bf16 model's RMSNorm runs in fp32, with an fp32 copy of each of its 2 L + 1 gains.
    gains = (2 * spec.n_layers + 1) * spec.d_model * 4 if mode == "bf16" else 0
    return rope + mask + gains + 4  # + the loss's fp32 scalar total weight


@pytest.mark.parametrize("mode,attention,precision", [
    ("fp32", "naive", "fp32"), ("fp32", "sdpa", "fp32"), ("bf16", "naive", "bf16_mixed")])
def test_accounting_matches_what_the_real_model_saves(mode, attention, precision):
    # CPU: "sdpa" is PyTorch's flash kernel for CPU (saves q, k, v, O and an fp32 LSE): our "flash" case.
    # Tolerance: none. Every per-token tensor is in the accounting and the batch-independent ones (RoPE
    # rows, causal mask, a scalar) are added here by hand, so the byte counts agree exactly.
    B, T = 2, 32
    measured = measure_saved_bytes(TINY, B, T, attention, mode)
    flash = "flash" if attention == "sdpa" else "naive"
    per_token = activation_bytes_per_token(TINY, T, precision, attention=flash, **CPU_NORM).total_bytes
    predicted = per_token * B * T
    assert measured == predicted + batch_independent_bytes(TINY, T, flash, mode)
    # Per token alone (what the calculator reports) is within 2% even at this tiny batch (1.1% fp32,
    # 1.6% bf16: the batch-independent tensors, about 10 KB here, shrink as 1 / batch).
    assert abs(measured - predicted) / measured < 0.02
    # Doubling the batch adds exactly the per-token prediction: the accounting scales with tokens.
    assert measure_saved_bytes(TINY, 2 * B, T, attention, mode) - measured == predicted


def test_cpu_autocast_weight_copies_and_per_token_terms():
    # CPU autocast keeps softmax in bf16 (CUDA's runs it in fp32): use the flash path, whose terms are the
    # same on both. Batch-independent extras here also include the bf16 weight copies (cast_weights).
    B, T = 2, 32
    measured = measure_saved_bytes(TINY, B, T, "sdpa", "autocast")
    per_token = activation_bytes_per_token(TINY, T, "bf16_autocast", attention="flash", **CPU_NORM).total_bytes
    assert measure_saved_bytes(TINY, 2 * B, T, "sdpa", "autocast") - measured == per_token * B * T
    cast = per_device_memory(TINY, "ddp", 1, B * T, T, "bf16_autocast", attention="flash").cast_weights
    assert measured == per_token * B * T + batch_independent_bytes(TINY, T, "flash") + cast


@pytest.mark.parametrize("mode,precision", [("fp32", "fp32"), ("autocast", "bf16_autocast"), ("bf16", "bf16_mixed")])
def test_compiled_blocks_save_what_the_accounting_says(mode, precision):
    # Inductor's partitioner recomputes part of what eager saves; activation_bytes_per_token(compiled=True) lists
    # what it keeps. Doubling the batch adds exactly that per token (the loss stays eager: the same extras).
    B, T = 2, 32
    per_token = activation_bytes_per_token(TINY, T, precision, attention="flash", compiled=True, **CPU_NORM)
    one, two = (measure_saved_bytes(TINY, b, T, "sdpa", mode, compiled=True) for b in (B, 2 * B))
    assert two - one == per_token.total_bytes * B * T
    eager = activation_bytes_per_token(TINY, T, precision, attention="flash", **CPU_NORM)
    assert per_token.total_bytes < eager.total_bytes


@pytest.mark.gpu
@pytest.mark.parametrize("mode,precision", [("autocast", "bf16_autocast"), ("bf16", "bf16_mixed")])
@pytest.mark.parametrize("attention", ["naive", "sdpa"])
def test_cuda_per_token_terms(attention, mode, precision):
    # CUDA autocast runs softmax in fp32 (naive keeps fp32 probabilities and a bf16 copy); bf16 SDPA is the
    # flash kernel. The batch-independent tensors include kernel RNG state; the batch difference cancels them.
    # (fp32 SDPA on CUDA is the memory-efficient kernel: not tested.)
    B, T = 2, 64
    flash = "flash" if attention == "sdpa" else "naive"
    per_token = activation_bytes_per_token(TINY, T, precision, attention=flash).total_bytes
    one = measure_saved_bytes(TINY, B, T, attention, mode, "cuda")
    two = measure_saved_bytes(TINY, 2 * B, T, attention, mode, "cuda")
    assert two - one == per_token * B * T


def test_mesh_strategies_as_memory_strategies():
    """Each mesh strategy of parallelism_calc.scaling (jax_impl.sharding's) has the memory strategy and mesh its
    state is sharded like; a strategy that leaves the tp axis replicating the work is refused."""
    from parallelism_calc.memory import mesh_memory_strategy
    from parallelism_calc.scaling import STRATEGIES as MESH_STRATEGIES

    expected = {"dp": ("ddp", ParallelSpec(dp=4)), "fsdp": ("fsdp", ParallelSpec(dp=2, fsdp=2)),
                "tp": ("fsdp_tp", ParallelSpec(dp=4, tp=1)), "fsdp_tp": ("fsdp_tp", ParallelSpec(dp=2, fsdp=2))}
    assert {s: mesh_memory_strategy(s, 2, 2, 1) for s in MESH_STRATEGIES} == expected
    assert mesh_memory_strategy("tp", 1, 2, 4) == ("fsdp_tp", ParallelSpec(dp=2, tp=4))
    assert mesh_memory_strategy("fsdp_tp", 1, 2, 4) == ("fsdp_tp", ParallelSpec(fsdp=2, tp=4))
    for strategy in ("dp", "fsdp"):
        with pytest.raises(ValueError, match="replicates work"):
            mesh_memory_strategy(strategy, 1, 2, 2)
    with pytest.raises(ValueError, match="accepted: dp, fsdp, tp, fsdp_tp"):
        mesh_memory_strategy("ddp", 1, 1, 1)

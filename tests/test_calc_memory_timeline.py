"""``per_device_memory(..., peak_model="timeline")``: the peak placed in the training step (forward's end, each
block's backward with its checkpointing, backward's end) against moments written out by hand on a toy spec.

The numbers below are derived here from the model's shapes, not from the module's helpers: per token one block
of our model saves (fp32 norms, as CUDA's fused RMSNorm keeps them: input and rsqrt) 2 (4 D + 4) + norm outputs +
4 D p + 4 F p + attention probabilities, the extras are the final norm (4 D + 4 + D p), the fp32 log-softmax (4 V)
and the int64 ids (8).
"""

import pytest

from parallelism_calc.memory import (CUDA_LIBRARY_WORKSPACES, PEAK_MODELS, activation_bytes_per_token,
                                     per_device_memory, reduce_scatter_queue)
from parallelism_calc.specs import MODELS, ModelSpec

# D 8, F 16, H 2, 2 layers, V 10. P = 80 (embedding) + 2 x 656 (blocks) + 8 (final norm) + 80 (LM head) = 1,480.
TOY = ModelSpec("toy", vocab_size=10, context_length=16, d_model=8, d_ff=16, n_layers=2, n_heads=2)
P = 1480
BLOCK = 4 * 8 * 8 + 3 * 8 * 16 + 2 * 8  # 656 parameters a block
S_DDP = 4 * P + 8 * P  # fp32 weights + AdamW m and v (fp32 and bf16_autocast alike), alive throughout

# bf16_autocast, naive attention, T = 16, one block per token, q, k and v as three products (``qkv_product=False``,
# our model before 767b604, as the fidelity report still predicts those runs; the one product's count is
# test_one_q_k_v_product_keeps_one_autocast_copy's): norms 2 x (32 + 4) = 72; five bf16 copies
# of the norm outputs (q, k, v, w1, w3) 5 x 8 x 2 = 80; q, k, v, attention output 4 x 8 x 2 = 64; SwiGLU
# 4 x 16 x 2 = 128; fp32 probabilities + their bf16 copy, 2 heads x 16 keys x (4 + 2) = 192.
B_AUTO = 72 + 80 + 64 + 128 + 192  # 536
E_AUTO = (32 + 4 + 8 * 2) + 4 * 10 + 8  # 100: final norm, log-softmax, token ids
A = 8 * 4  # a checkpoint: one block input, the fp32 residual stream
C_BLOCK = (4 * 8 * 8 + 3 * 8 * 16) * 2  # 1,280: a block's bf16 weight copies (its matmuls)
C_HEAD = 10 * 8 * 2  # 160: the LM head's
G_BLOCK, G_TOP, G_ALL = BLOCK * 4, (10 * 8 + 8) * 4, P * 4  # fp32 gradients: a block, LM head + final norm, all


def _timeline(**kw):
    args = dict(strategy="ddp", n_devices=1, batch_tokens=4 * 16, seq_len=16, precision="bf16_autocast",
                attention="naive", peak_model="timeline", qkv_product=False)
    return per_device_memory(TOY, **{**args, **kw})


def test_no_checkpointing_peak_is_the_largest_moment_by_hand():
    t = 64  # tokens
    saved = t * (2 * B_AUTO + E_AUTO) + 2 * C_BLOCK + C_HEAD  # 77,728: every activation and copy, no grad
    # The plain loss's working buffers: the bf16 logits and their fp32 copy in the forward, t V (2 + 4); nll's and
    # log-softmax's fp32 gradients in its backward, t V (4 + 4), beside what the forward saved.
    loss_forward, loss_backward = t * 10 * 6, t * 10 * 8  # 3,840 and 5,120
    block1 = G_TOP + t * 2 * B_AUTO + 2 * C_BLOCK  # 71,520: the head's gradients written, both blocks' live
    block0 = G_TOP + G_BLOCK + t * B_AUTO + C_BLOCK  # 38,560
    assert max(saved + loss_forward, saved + loss_backward, block1, block0, G_ALL) == saved + loss_backward
    got = _timeline()
    assert got.total == S_DDP + saved + loss_backward == 100_608
    assert got.peak_at == "loss backward" and got.loss_buffers == loss_backward
    assert (got.grads, got.activations, got.cast_weights) == (0, t * (2 * B_AUTO + E_AUTO), 2 * C_BLOCK + C_HEAD)
    assert got.total == pytest.approx(got.params + got.grads + got.master + got.optimizer + got.activations
                                      + got.gathered + got.cast_weights + got.loss_buffers)
    # The sum model adds every gradient on top and leaves the plain loss's buffers out (XLA fuses that loss).
    total = per_device_memory(TOY, "ddp", 1, 64, 16, "bf16_autocast", attention="naive", qkv_product=False).total
    assert total == got.total + G_ALL - loss_backward
    # The plain loss compiled by Inductor (the e2e benchmark's --compile): its buffers not counted, the forward's end
    compiled = _timeline(compiled_loss=True)
    assert (compiled.total, compiled.peak_at, compiled.loss_buffers) == (S_DDP + saved, "forward's end", 0)


def test_the_written_out_norm_and_the_workspaces_through_the_timeline():
    """fused_norm=False adds x / rms, 4 D bytes a norm and token, to every moment that holds activations: at the
    toy's peak 64 tokens x (2 L + 1) norms x 4 D. workspaces are held at every moment, in both peak models."""
    fused, written_out = _timeline(), _timeline(fused_norm=False)
    assert written_out.activations - fused.activations == 64 * (2 * 2 + 1) * 4 * 8
    assert written_out.peak_at == fused.peak_at and written_out.total - fused.total == 64 * 5 * 32
    for peak_model in PEAK_MODELS:
        plain = _timeline(peak_model=peak_model)
        held = _timeline(peak_model=peak_model, workspaces=CUDA_LIBRARY_WORKSPACES)
        assert held.total - plain.total == CUDA_LIBRARY_WORKSPACES == held.workspaces
        assert held.peak_at == plain.peak_at
    short = dict(batch_tokens=2, seq_len=2)  # the backward's end is the peak: the workspaces are there too
    assert _timeline(**short, workspaces=1024).total == _timeline(**short).total + 1024
    with pytest.raises(ValueError, match="bytes >= 0"):
        _timeline(workspaces=-1)
    from analysis.harness import device_terms

    assert device_terms("cpu") == {"fused_norm": False, "workspaces": 0}
    assert device_terms("cuda") == {"fused_norm": True, "workspaces": CUDA_LIBRARY_WORKSPACES}


def test_short_sequences_peak_at_the_backward_s_end():
    # T = 2, one sequence: probabilities 2 x 2 x 6 = 24 a token, so a block keeps 72 + 80 + 64 + 128 + 24 = 368.
    b = 368
    forward_end = 2 * (2 * b + E_AUTO) + 2 * C_BLOCK + C_HEAD  # 4,392
    block1 = G_TOP + 2 * 2 * b + 2 * C_BLOCK  # 4,384
    assert max(forward_end, block1) < G_ALL  # 5,920: every gradient, activations all freed
    got = _timeline(batch_tokens=2, seq_len=2)
    assert (got.total, got.peak_at, got.grads, got.activations) == (S_DDP + G_ALL, "backward's end", G_ALL, 0)


def test_checkpointing_every_k_by_hand():
    t = 64
    # K = 1, flat: the forward keeps two block inputs; block 0's moment (both blocks' gradients but one written,
    # its own input, one block recomputed and its copies) is the peak.
    k1 = {"forward's end": t * (2 * A + E_AUTO) + C_HEAD,  # 10,656
          "backward, block 1": G_TOP + t * (2 * A + B_AUTO) + C_BLOCK,  # 40,032
          "backward, block 0": G_TOP + G_BLOCK + t * (A + B_AUTO) + C_BLOCK,  # 40,608
          "backward's end": G_ALL}
    got = _timeline(checkpoint_every=1)
    assert (got.total, got.peak_at) == (S_DDP + max(k1.values()), "backward, block 0") == (58_368, got.peak_at)
    assert got.grads == G_TOP + G_BLOCK and got.activations == t * (A + B_AUTO) and got.cast_weights == C_BLOCK
    # "full" (each block recomputed from its input) is K = 1, flat.
    assert _timeline(checkpointing="full").total == got.total
    # K = 2, flat: one segment; recomputing it brings both blocks back while only the head's gradients exist.
    k2 = {"forward's end": t * (A + E_AUTO) + C_HEAD,  # 8,608
          "backward, block 1": G_TOP + t * (A + 2 * B_AUTO) + 2 * C_BLOCK,  # 73,568
          "backward, block 0": G_TOP + G_BLOCK + t * (A + B_AUTO) + C_BLOCK}  # 40,608
    got = _timeline(checkpoint_every=2)
    assert (got.total, got.peak_at) == (S_DDP + max(k2.values()), "backward, block 1") == (91_328, got.peak_at)
    # K = 2, nested: the recomputed segment checkpoints block 1's input again and recomputes one block at a time.
    nested = {"backward, block 1": G_TOP + t * (A + A + B_AUTO) + C_BLOCK,  # 40,032
              "backward, block 0": G_TOP + G_BLOCK + t * (A + B_AUTO) + C_BLOCK}  # 40,608
    got = _timeline(checkpoint_every=2, nested_checkpoint=True)
    assert (got.total, got.peak_at) == (S_DDP + max(nested.values()), "backward, block 0")
    # K >= L is one segment of every block: the same as K = L.
    assert _timeline(checkpoint_every=5).total == _timeline(checkpoint_every=2).total


def test_sharded_gradients_and_state_still_apply():
    # fp32, ZeRO-2 over 2 ranks, T = 2 and one sequence per rank: gradients (4 B) and AdamW state (8 B) halve.
    # A block per token: norms 72, norm outputs 2 x 8 x 4 = 64, 4 D p = 128, 4 F p = 256, probabilities
    # 2 x 2 x 4 = 16: 536; extras 32 + 4 + 32 + 40 + 8 = 116.
    got = per_device_memory(TOY, "zero2", 2, 4, 2, "fp32", attention="naive", peak_model="timeline")
    forward_end = 2 * (2 * 536 + 116)  # 2,376
    block1 = G_TOP / 2 + 2 * 2 * 536  # 2,320
    assert max(forward_end, block1) < G_ALL / 2  # 2,960
    assert got.total == 4 * P + 8 * P / 2 + G_ALL / 2 and got.peak_at == "backward's end"
    assert got.optimizer == 8 * P / 2 and got.cast_weights == 0
    # One device, unsharded: the same moments with every gradient.
    one = per_device_memory(TOY, "ddp", 1, 2, 2, "fp32", attention="naive", peak_model="timeline")
    assert one.total == S_DDP + G_ALL


def test_timeline_never_above_the_sum_and_options_checked():
    spec = MODELS["small"]
    for precision in ("fp32", "bf16_autocast", "bf16_mixed"):
        for strategy, n in (("ddp", 1), ("zero1", 4), ("zero2", 4), ("fsdp", 4)):
            kw = dict(precision=precision, attention="flash")
            s = per_device_memory(spec, strategy, n, 4 * 4 * 512, 512, **kw)
            t = per_device_memory(spec, strategy, n, 4 * 4 * 512, 512, peak_model="timeline", **kw)
            # the sum leaves the plain loss's buffers out (the JAX rows' model: XLA fuses that loss)
            assert t.total <= s.total + t.loss_buffers and t.params == s.params and t.optimizer == s.optimizer
            assert t.gathered == s.gathered and t.master == s.master
    assert PEAK_MODELS == ("sum", "timeline")
    for kw, message in ((dict(peak_model="max"), "accepted: sum, timeline"),
                        (dict(peak_model="sum", checkpoint_every=2), "needs peak_model='timeline'"),
                        (dict(checkpointing="full", checkpoint_every=2), "checkpointing='none'"),
                        (dict(checkpoint_every=0), "must be >= 1")):
        with pytest.raises(ValueError, match=message):
            _timeline(**kw)


def test_gradient_buckets_stay_alive_through_the_step():
    """DDP's flat buckets (bucketed, ZeRO-1 over it, torch DDP) hold every gradient from step to step: P x bytes more
    at every moment of the timeline, and in the sum; ZeRO-2 keeps slices of them, the same bytes over N ranks."""
    for precision, nbytes in (("fp32", 4), ("bf16_autocast", 4), ("bf16_autocast", 2)):
        for peak_model in ("sum", "timeline"):
            kw = dict(precision=precision, attention="naive", peak_model=peak_model)
            plain = per_device_memory(TOY, "ddp", 2, 4 * 16, 16, **kw)
            bucketed = per_device_memory(TOY, "ddp", 2, 4 * 16, 16, gradient_buckets=nbytes, **kw)
            assert bucketed.buckets == P * nbytes and plain.buckets == 0
            assert bucketed.total - plain.total == P * nbytes and bucketed.peak_at == plain.peak_at
    # One device without buckets: the timeline's S + gradients at the backward's end, as above, plus P x 4.
    one = per_device_memory(TOY, "ddp", 1, 2, 2, "fp32", attention="naive", peak_model="timeline", gradient_buckets=4)
    assert one.total == S_DDP + G_ALL + 4 * P
    # ZeRO-2's slices: the same bytes a parameter, sharded over the ranks
    for n_dev in (2, 4):
        plain = per_device_memory(TOY, "zero2", n_dev, 4 * 16, 16, attention="naive", peak_model="timeline")
        sliced = per_device_memory(TOY, "zero2", n_dev, 4 * 16, 16, attention="naive", peak_model="timeline",
                                   gradient_buckets=6)
        assert sliced.buckets == P * 6 / n_dev and sliced.total - plain.total == P * 6 / n_dev
    for strategy, value, message in (("fsdp", 4, "with strategy ddp, zero1 or zero2"),
                                     ("ddp", -1, "bytes a parameter >= 0")):
        with pytest.raises(ValueError, match=message):
            per_device_memory(TOY, strategy, 2, 4 * 16, 16, gradient_buckets=value)


def test_compiled_blocks_save_what_inductor_keeps():
    """compiled=True: per layer per token w D + 2 x 4 + 2 D p + 5 D p + 4 H + 3 F p (w: the residual stream's bytes,
    p: the compute dtype's), written out here for the toy spec; the extras and the state are the eager ones."""
    d, f, h = 8, 16, 2
    for precision, w, p in (("fp32", 4, 4), ("bf16_autocast", 4, 2), ("bf16_mixed", 2, 2)):
        got = activation_bytes_per_token(TOY, 16, precision, "none", "flash", compiled=True)
        eager = activation_bytes_per_token(TOY, 16, precision, "none", "flash")
        assert got.per_layer_bytes == w * d + 8 + 7 * d * p + 4 * h + 3 * f * p, precision
        assert got.extra_bytes == eager.extra_bytes and got.per_layer_bytes < eager.per_layer_bytes
        one = per_device_memory(TOY, "ddp", 1, 4 * 16, 16, precision, attention="flash", peak_model="timeline",
                                compiled=True)
        base = per_device_memory(TOY, "ddp", 1, 4 * 16, 16, precision, attention="flash", peak_model="timeline")
        assert one.params == base.params and one.optimizer == base.optimizer and one.total < base.total
    for kw in (dict(attention="naive"), dict(checkpointing="selective")):
        with pytest.raises(ValueError, match="measured for a transformer with flash attention"):
            activation_bytes_per_token(TOY, 16, "bf16_autocast", **{"attention": "flash", **kw}, compiled=True)
    with pytest.raises(ValueError, match="measured without checkpointing"):
        per_device_memory(TOY, "ddp", 1, 64, 16, attention="flash", peak_model="timeline", checkpoint_every=1,
                          compiled=True)


# Stage 3 on the toy spec, 2 ranks, bf16 autocast: our FSDP(gather_unit="layer") (each weight matrix a unit, 2
# prefetched, 2 reduce-scatters in flight), its residual stream in bf16 (the embedding is gathered in bf16).
FSDP_KW = dict(precision="bf16_autocast", attention="naive", gather_unit="layer", prefetch_layers=2,
               pending_reduce_scatters=2, compute_dtype_stream=True, peak_model="timeline", qkv_product=False)
S_FSDP = P * 4 / 2 + P * 8 / 2  # fp32 weight shards + AdamW m and v, sharded over 2
UNIT = 8 * 16  # the largest weight matrix (D x F = 128 > V x D = 80)
GATHERED = 3 * UNIT * 2  # the unit in use + 2 prefetched, bf16: 768
# A reduce-scatter in flight (kept: our FSDP's rank-major input and output piece, bf16 over 2 ranks) holds 2 x 1.5
# = 3 bytes a parameter of its unit and keeps 2 (its fp32 sharded gradient, 4 / 2) unwritten until it lands. The
# units in the backward's order: the LM head (V D = 80), the 7 matrices of block 1, of block 0 (each counted as the
# largest, 128), the embedding (80). At block 1's backward the head's is in flight; at a block's reduce-scatter,
# once its last matrix is launched, 3 (k + 1) of its matrices; at block 0's backward the last 2 of block 1's.
HELD, UNLANDED = 3, 2


def test_fsdp_buffers_at_the_forward_s_end_by_hand():
    """T 16, 64 tokens a rank: one shared bf16 norm output a norm (2 x 8 x 2, not five copies: 536 - 48 = 488 a
    block); no autocast weight copies; the reduce-scatter buffers exist in the backward only, after the loss's."""
    pred = per_device_memory(TOY, "fsdp", 2, 2 * 4 * 16, 16, **FSDP_KW)
    b = B_AUTO - 3 * 8 * 2
    loss_backward = 64 * 10 * 8  # the plain loss's two fp32 gradients of the logits: 5,120
    saved = 64 * (2 * b + E_AUTO)  # 68,864
    block1 = G_TOP / 2 + 80 * (HELD - UNLANDED) + 64 * 2 * b  # 62,720: the LM head's reduce-scatter in flight
    block1_rs = G_TOP / 2 + G_BLOCK / 2 + 3 * UNIT * (HELD - UNLANDED) + 64 * b  # 33,104
    assert saved + loss_backward > block1 > block1_rs
    assert (pred.peak_at, pred.total) == ("loss backward", S_FSDP + GATHERED + saved + loss_backward)
    assert pred.reduce_scatter == 0 and pred.cast_weights == 0
    # Without the compute-dtype stream the norm outputs are five autocast copies again (the JAX meshes' count)
    plain = per_device_memory(TOY, "fsdp", 2, 2 * 4 * 16, 16, **{**FSDP_KW, "compute_dtype_stream": False})
    assert plain.total - pred.total == 64 * 2 * 3 * 8 * 2


def test_fsdp_buffers_in_the_backward_by_hand():
    """T 2, 2 tokens a rank: the gradients win; at the backward's end the sharded gradients, less the 3 units still
    in flight (block 0's last two matrices and the embedding), and their buffers."""
    pred = per_device_memory(TOY, "fsdp", 2, 2 * 2, 2, **FSDP_KW)
    b = 72 + 2 * 8 * 2 + 64 + 128 + 2 * 2 * 6  # 320: naive probabilities over 2 keys
    loss = 2 * 10 * (2 + 4), 2 * 10 * 8  # the plain loss's forward and backward buffers, 2 tokens
    in_flight = {  # (held, unlanded) at each backward moment, from the units listed above FSDP_KW's
        "backward, block 1": (80 * HELD, 80 * UNLANDED), "backward, block 1's reduce-scatter": (
            3 * UNIT * HELD, 3 * UNIT * UNLANDED), "backward, block 0": (2 * UNIT * HELD, 2 * UNIT * UNLANDED),
        "backward, block 0's reduce-scatter": (3 * UNIT * HELD, 3 * UNIT * UNLANDED),
        "backward's end": ((2 * UNIT + 80) * HELD, (2 * UNIT + 80) * UNLANDED)}
    written = {"backward, block 1": G_TOP / 2, "backward, block 1's reduce-scatter": (G_TOP + G_BLOCK) / 2,
               "backward, block 0": (G_TOP + G_BLOCK) / 2, "backward, block 0's reduce-scatter": (
                   G_TOP + 2 * G_BLOCK) / 2, "backward's end": G_ALL / 2}
    live = {"backward, block 1": 2 * b, "backward, block 1's reduce-scatter": b, "backward, block 0": b,
            "backward, block 0's reduce-scatter": 0, "backward's end": 0}
    moments = {"forward's end": 2 * (2 * b + E_AUTO) + loss[0], "loss backward": 2 * (2 * b + E_AUTO) + loss[1],
               **{m: written[m] - in_flight[m][1] + in_flight[m][0] + 2 * live[m] for m in live}}
    assert moments == {"forward's end": 1600, "loss backward": 1640, "backward, block 1": 1536,
                       "backward, block 1's reduce-scatter": 2512, "backward, block 0": 2384,
                       "backward, block 0's reduce-scatter": 3184, "backward's end": 3296}
    assert pred.peak_at == max(moments, key=moments.get) == "backward's end"
    assert pred.total == S_FSDP + GATHERED + moments["backward's end"]
    assert (pred.reduce_scatter, pred.grads) == (1008, G_ALL / 2 - 672)
    # The sum model adds the most ever in flight (3 of the largest matrices) to every other term
    total = per_device_memory(TOY, "fsdp", 2, 2 * 2, 2, **{**FSDP_KW, "peak_model": "sum"})
    assert total.reduce_scatter == 3 * UNIT * HELD == 1152
    assert total.total == S_FSDP + G_ALL / 2 + 2 * (2 * b + E_AUTO) + GATHERED + 1152
    # FSDP2: a block a unit, one reduce-scatter in flight holding its input only (2 bytes a parameter; the output
    # is cast into the sharded gradient at launch, the previous input released before): at block 1's backward
    # nothing (its root is reduce-scattered last), at block 1's reduce-scatter and block 0's backward block 1's,
    # at block 0's reduce-scatter block 0's: the peak, with every block's gradient written (G_TOP + 2 G_BLOCK).
    fsdp2 = per_device_memory(TOY, "fsdp", 2, 2 * 2, 2, **{**FSDP_KW, "gather_unit": "block", "prefetch_layers": 1,
                                                          "reshard_root": False, "pending_reduce_scatters": 1,
                                                          "reduce_scatter_output": "landed"})
    gathered2 = (2 * 80 + 8 + 2 * BLOCK) * 2
    assert (fsdp2.peak_at, fsdp2.reduce_scatter, fsdp2.grads) == (
        "backward, block 0's reduce-scatter", BLOCK * 2, (G_TOP + 2 * G_BLOCK) / 2)
    assert fsdp2.total == S_FSDP + gathered2 + (G_TOP + 2 * G_BLOCK) / 2 + BLOCK * 2


def test_reduce_scatters_in_flight_as_the_2xh200_snapshots_hold_them():
    """CUDA allocator snapshots of the eager 2.7B 4 x 512 step (bf16 autocast) on 2 H200s at dc34675
    (results/profiles/ddp_snapshots_2xh200_dc34675.tar.xz, notes/fidelity.md, session 42 (helper)), read with
    ``analysis.snapshot``: the bytes the reduce-scatters in flight hold, as allocated. Ours (fsdp.py,
    ``_reduce_scatter_grads``): a block's rank-major ``flat``, 209,715,200 (4 D^2 + 3 D F in bf16; the norm gains are
    replicated), and its ``piece``, 104,857,600; the LM head's ``flat`` is autograd's gradient itself (V D = 25.6 M in
    bf16, 51,200,000) and its piece 25,600,000. At the step's peak (28.11 GiB, block 29's backward: 30 blocks'
    activations) two blocks' flat and piece, 629,145,600, and no unsharded gradient of the block in use; as a block's
    is launched, three. FSDP2 (``foreach_reduce``): at its peak (28.16 GiB, block 30's backward) block 31's
    ``reduce_scatter_input``, 209,725,440 (the block with its norm gains), its output already cast to fp32. The
    formula before held u p (1 + 3 (1 + 1 / 2)) = 1,153,489,920 bytes (ours) at every moment of the backward."""
    spec = MODELS["2.7B"]
    flat, piece, head = 209_715_200, 104_857_600, 51_200_000 + 25_600_000
    gains = 2 * spec.d_model * 2 * 1.5  # a block's norm gains: in the calculator's block unit, not in ours
    ours = reduce_scatter_queue(spec, 2, 2, "bf16_autocast")
    assert ours.after(ours.first_block)[0] == head  # block 31's backward: the LM head's alone
    assert ours.after(ours.first_block + 1)[0] == head + flat + piece + gains  # block 30's
    assert ours.after(ours.first_block + 2)[0] == 2 * (flat + piece + gains) == 629_176_320  # block 29's: the peak
    assert ours.after(ours.first_block + 3, launching=True)[0] == 3 * (flat + piece + gains)  # block 29's launch
    assert ours.most_held() == 3 * (flat + piece + gains) < spec.n_params_per_layer() * 2 * 5.5 == 1_153_489_920
    fsdp2 = reduce_scatter_queue(spec, 1, 2, "bf16_autocast", reshard_root=False, output="landed")
    assert fsdp2.after(0)[0] == 0 and fsdp2.after(1)[0] == fsdp2.after(2, launching=True)[0] == 209_725_440
    assert fsdp2.unlanded_bytes == 0 and ours.unlanded_bytes == 4 / 2


def test_reduce_scatter_buffers_need_stage_3():
    with pytest.raises(ValueError, match="stage-3 strategy"):
        per_device_memory(TOY, "ddp", 2, 4 * 16, 16, pending_reduce_scatters=2)
    with pytest.raises(ValueError, match="in flight >= 0"):
        per_device_memory(TOY, "fsdp", 2, 4 * 16, 16, pending_reduce_scatters=-1)
    # Not stage 3: the compute-dtype stream changes nothing (the weights are read in their own dtype)
    kw = dict(precision="bf16_autocast", attention="naive", peak_model="timeline")
    assert per_device_memory(TOY, "ddp", 2, 4 * 16, 16, compute_dtype_stream=True, **kw) == \
        per_device_memory(TOY, "ddp", 2, 4 * 16, 16, **kw)


def test_one_q_k_v_product_keeps_one_autocast_copy():
    """q, k and v as one product (the default, ``torch_impl.qkv_projection``) cast the first norm's output once under
    autocast: 2 of the 5 copies fewer, 2 x 8 x 2 bytes a token and block (64 tokens, 2 blocks); nothing else moves,
    and without autocast, or with the residual stream in the compute dtype, nothing at all."""
    one, three = _timeline(qkv_product=True), _timeline()
    assert three.activations - one.activations == three.total - one.total == 64 * 2 * (2 * 8 * 2)
    for kw in (dict(precision="bf16_mixed"), dict(precision="fp32"), dict(compute_dtype_stream=True,
                                                                           strategy="fsdp", n_devices=2)):
        assert _timeline(qkv_product=True, **kw).total == _timeline(**kw).total, kw


def test_accumulated_micro_batches_hold_every_gradient_by_hand():
    """A step of several micro-batches (``grad_accum``): from the second on, every gradient is alive at every moment,
    so the loss's backward, the largest moment of one micro-batch, holds G too; one micro-batch is unchanged; the
    sum model counts G anyway; a count that is not an integer >= 1 is refused, and so is zero2's."""
    t = 64
    saved = t * (2 * B_AUTO + E_AUTO) + 2 * C_BLOCK + C_HEAD  # the forward's end (see the first test)
    one, four = _timeline(), _timeline(grad_accum=4)
    assert four.total == S_DDP + G_ALL + saved + t * 10 * 8 == one.total + G_ALL
    assert (four.peak_at, four.grads) == ("loss backward", G_ALL) and four.formulas["grads"].startswith("every")
    assert _timeline(grad_accum=1).total == one.total
    summed = dict(strategy="ddp", n_devices=1, batch_tokens=64, seq_len=16, attention="naive", qkv_product=False)
    assert per_device_memory(TOY, **summed, grad_accum=4).total == per_device_memory(TOY, **summed).total
    for bad in (0, 2.5):
        with pytest.raises(ValueError, match=f"grad_accum={bad}"):
            _timeline(grad_accum=bad)
    with pytest.raises(ValueError, match="zero2"):  # ours holds whole gradients under no_sync: not modelled
        _timeline(strategy="zero2", n_devices=2, grad_accum=2)

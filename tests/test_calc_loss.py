"""The calculator's loss terms (issue 19 item 4): what the plain and the fused loss save and hold, the memory and
time floor of the leaderboard's step, and ``python -m parallelism_calc ... --loss fused --hardware h200``.

Independent checks: hand calculations written out here (the lm8b figures of notes/train_step.md's table), and the
tensors the real ``TransformerLM(loss="fused")`` saves for backward, counted with ``saved_tensors_hooks`` as
tests/test_calc_memory.py counts the plain model's.
"""

import contextlib
import json

import pytest

from parallelism_calc.__main__ import main as calc_main
from parallelism_calc.memory import (activation_bytes_per_token, default_loss_chunk, loss_buffer_bytes,
                                     per_device_memory)
from parallelism_calc.roofline import matmul_flops, recompute_flops
from parallelism_calc.specs import MODELS
from tests.test_calc_memory import CPU_NORM, batch_independent_bytes

LM8B, TINY = MODELS["lm8b"], MODELS["tiny"]
V, D = 151_936, 4096


def test_lm8b_loss_buffers_by_hand():
    # notes/train_step.md: one of 2 GPUs, N = 32,768 tokens, bf16 logits (p = 2)
    n = 32_768
    plain = loss_buffer_bytes(LM8B, n, "bf16_autocast", "plain")
    assert plain.forward == n * V * (2 + 4)  # the logits and their fp32 copy (the log-softmax is saved)
    assert plain.backward == n * V * 8  # nll's gradient and log-softmax's input gradient
    assert default_loss_chunk(V) == 512 and 512 * V * 4 <= 512 * 2**20 < 1024 * V * 4
    fused = loss_buffer_bytes(LM8B, n, "bf16_autocast", "fused")
    assert fused.forward == 512 * V * 8 == 622_329_856  # 622 MB
    assert fused.backward == 512 * V * 6 + V * D * 4  # 467 MB + 2.49 GB
    assert fused.peak == fused.backward
    # fp32 logits: no widening copy; a chunk smaller than the batch is the batch
    assert loss_buffer_bytes(LM8B, n, "fp32", "plain").forward == n * V * 4
    assert loss_buffer_bytes(LM8B, 100, "fp32", "fused").backward == 100 * V * 4 + V * D * 4
    with pytest.raises(ValueError, match="unknown loss 'cut'"):
        loss_buffer_bytes(LM8B, n, loss="cut")


def test_fused_extras_by_hand():
    plain = activation_bytes_per_token(TINY, 32, "fp32", loss="plain")
    fused = activation_bytes_per_token(TINY, 32, "fp32", loss="fused")
    assert "extra.loss_log_softmax" not in fused.terms and fused.terms["extra.loss_lse"] == 4
    assert plain.total_bytes - fused.total_bytes == 512 * 4 - 4


def _saved_bytes(batch, seq, mode, loss):
    """Unique non-parameter storages saved by one forward + loss of ``TransformerLM(tiny, loss=loss)``; targets are
    the input ids (one storage, as tests/test_calc_memory.py measures)."""
    torch = pytest.importorskip("torch")
    from torch_impl.model import TransformerLM, cross_entropy

    torch.manual_seed(0)
    model = TransformerLM(TINY, attention="sdpa", loss=loss)
    tokens = torch.randint(0, TINY.vocab_size, (batch, seq))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast" else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        model(tokens, tokens) if loss == "fused" else cross_entropy(model(tokens), tokens)
    return sum(saved.values())


@pytest.mark.parametrize("mode,precision", [("fp32", "fp32"), ("autocast", "bf16_autocast")])
def test_fused_loss_saves_what_the_accounting_says(mode, precision):
    B, T = 2, 32
    per_token = activation_bytes_per_token(TINY, T, precision, attention="flash", loss="fused", **CPU_NORM).total_bytes
    measured = _saved_bytes(B, T, mode, "fused")
    assert _saved_bytes(2 * B, T, mode, "fused") - measured == per_token * B * T  # exact, per token
    if mode == "fp32":  # the batch-independent tensors, less the plain loss's scalar total weight (4 bytes)
        assert measured == per_token * B * T + batch_independent_bytes(TINY, T, "flash") - 4
    # and the plain loss saves 4 (V - 1) bytes a token more, the log-softmax against the log-sum-exp
    assert _saved_bytes(B, T, mode, "plain") - measured == (TINY.vocab_size - 1) * 4 * B * T + 4


def test_per_device_memory_with_the_fused_loss():
    tokens, seq = 65_536, 32_768
    kw = dict(attention="flash", checkpointing="full")
    plain = per_device_memory(LM8B, "fsdp", 2, tokens, seq, "bf16_autocast", **kw)
    fused = per_device_memory(LM8B, "fsdp", 2, tokens, seq, "bf16_autocast", loss="fused", **kw)
    per_rank = tokens // 2
    assert plain.activations - fused.activations == per_rank * (V * 4 - 4)  # 19.9 GB of log-softmax
    assert fused.loss_buffers == loss_buffer_bytes(LM8B, per_rank, "bf16_autocast", "fused").peak
    assert fused.total == pytest.approx(plain.total - per_rank * (V * 4 - 4) + fused.loss_buffers)
    # timeline: the loss's backward is a moment of its own, its buffers beside the forward's activations
    timeline = per_device_memory(LM8B, "fsdp", 2, tokens, seq, "bf16_autocast", attention="flash", loss="fused",
                                 checkpoint_every=1, peak_model="timeline")
    assert timeline.peak_at in ("loss backward", "forward's end") or timeline.peak_at.startswith("backward")
    huge_vocab = LM8B.replace(vocab_size=4_000_000)  # dW's accumulator dominates: the loss's backward is the peak
    t = per_device_memory(huge_vocab, "fsdp", 2, tokens, seq, "bf16_autocast", attention="flash", loss="fused",
                          checkpoint_every=1, peak_model="timeline")
    assert t.peak_at == "loss backward" and t.loss_buffers == loss_buffer_bytes(huge_vocab, per_rank, loss="fused").backward


def test_recompute_flops_by_hand():
    b, t, d, f, v, layers = 2, 32, 64, 176, 512, 2
    head = 2 * b * t * d * v
    block = 2 * b * t * (4 * d * d + 3 * d * f) + 2 * b * t * t * d  # causal: half of scores + values
    assert matmul_flops(TINY, b, t, "forward") == layers * block + head
    assert recompute_flops(TINY, b, t) == 0
    assert recompute_flops(TINY, b, t, recompute_blocks=1) == layers * block
    assert recompute_flops(TINY, b, t, recompute_blocks=2, loss="fused") == 2 * layers * block + head
    assert recompute_flops(TINY, b, t, selective=True) == layers * 2 * b * t * t * d


def _calc_json(capsys, *args):
    assert calc_main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_leaderboard_command(capsys):
    """lm8b at 2 x 32,768 on 2 H200s: the FSDP row fits the H200's 141 GB with the fused loss, and the step's floor
    is the 4 forwards of full checkpointing at the datasheet's 989.5 TFLOP/s (a little over 3 s)."""
    args = ["lm8b", "--fsdp", "2", "--seq-len", "32768", "--batch-tokens", "65536", "--checkpointing", "full",
            "--attention", "flash", "--hardware", "h200"]
    fused = _calc_json(capsys, *args, "--loss", "fused")
    plain = _calc_json(capsys, *args)
    assert fused["inputs"]["device_bytes"] == 141e9 and fused["inputs"]["loss"] == "fused"
    fsdp = fused["sections"]["memory"]["quantities"]["fsdp"]
    assert fsdp["note"] == "fits in 141 GB" and 90e9 < fsdp["value"] < 100e9
    plain_fsdp = plain["sections"]["memory"]["quantities"]["fsdp"]
    assert plain_fsdp["value"] - fsdp["value"] == pytest.approx(32_768 * (V * 4 - 4) - 2_956_066_816)
    floor = {key: q["value"] for key, q in fused["sections"]["floor"]["quantities"].items()}
    matmul = (3 * matmul_flops(LM8B, 1, 32_768, "forward") + recompute_flops(LM8B, 1, 32_768, 1, loss="fused"))
    assert floor["matmul_s"] == pytest.approx(matmul / 989.5e12)
    assert 3.0 < floor["total_s"] < 3.6
    # without --hardware: no floor section, and the H100-sized default device
    bare = _calc_json(capsys, "lm8b", "--fsdp", "2", "--seq-len", "32768", "--batch-tokens", "65536")
    assert "floor" not in bare["sections"] and bare["inputs"]["device_bytes"] == 80e9

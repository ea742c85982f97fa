"""FLOP formulas against torch's own FLOP counter on the real model (an independent count)."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from parallelism_calc.compute import forward_flops, step_flops
from parallelism_calc.specs import MODELS
from torch_impl.model import TransformerLM, cross_entropy


def counted_flops(model, tokens, backward=False):
    with FlopCounterMode(display=False) as counter:
        logits = model(tokens)
        if backward:
            cross_entropy(logits, tokens).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("batch,seq", [(1, 16), (3, 40)])
def test_forward_flops_match_torch_flop_counter(batch, seq):
    spec = MODELS["tiny"]
    model = TransformerLM(spec, attention="naive")  # naive attention: scores and values are plain matmuls
    tokens = torch.randint(0, spec.vocab_size, (batch, seq))
    assert forward_flops(spec, batch, seq) == counted_flops(model, tokens)


def test_train_step_is_three_forwards_and_close_to_counted_backward():
    spec = MODELS["tiny"]
    model = TransformerLM(spec)
    tokens = torch.randint(0, spec.vocab_size, (2, 32))
    assert step_flops(spec, 2, 32, "train_step") == 3 * forward_flops(spec, 2, 32)
    # Every product gets an input-gradient and a weight-gradient product in the backward (the first
    # block's input gradient feeds the embedding's), so the 3x convention is exact for this model.
    assert counted_flops(model, tokens, backward=True) == step_flops(spec, 2, 32, "forward_backward")


def test_ffn_only_and_bad_mode():
    xxl = MODELS["xxl"]
    assert forward_flops(xxl, 1, 1) == 2 * xxl.n_params()  # 2 FLOPs per weight per token
    with pytest.raises(ValueError, match="accepted: forward"):
        step_flops(xxl, 1, 1, "inference")

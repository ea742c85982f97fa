"""Activation checkpointing: the same loss and gradients, fewer tensors saved for backward."""

import pytest
import torch

from parallelism_calc.specs import MODELS
from torch_impl.activation_checkpointing import apply_activation_checkpointing
from torch_impl.model import TransformerLM, cross_entropy

SPEC = MODELS["tiny"].replace(n_layers=4)


def saved_bytes(model, tokens):
    """Bytes of the distinct non-parameter tensors autograd keeps for backward during one forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    return loss, sum(storages.values())


def grads_by_block(model):
    """Gradients keyed by (block index, name within the block), whatever the segment nesting."""
    blocks = [b for seg in model.layers for b in (seg.blocks if hasattr(seg, "blocks") else [seg])]
    return {(i, n): p.grad.clone() for i, b in enumerate(blocks) for n, p in b.named_parameters()}


@pytest.mark.parametrize("every,nested", [(1, False), (2, False), (3, False), (2, True)])
def test_same_gradients_less_memory(every, nested):
    torch.manual_seed(0)
    reference = TransformerLM(SPEC)
    model = TransformerLM(SPEC)
    model.load_state_dict(reference.state_dict())
    apply_activation_checkpointing(model, every, nested)
    tokens = torch.randint(0, SPEC.vocab_size, (2, 33))
    ref_loss, ref_bytes = saved_bytes(reference, tokens)
    loss, ckpt_bytes = saved_bytes(model, tokens)
    ref_loss.backward()
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    expected = grads_by_block(reference)
    for key, grad in grads_by_block(model).items():
        torch.testing.assert_close(grad, expected[key], rtol=1e-6, atol=1e-7)
    assert ckpt_bytes < ref_bytes / 2  # only segment inputs (and the head's tensors) are kept


def test_segments_and_errors():
    model = apply_activation_checkpointing(TransformerLM(SPEC), every=3)
    assert [len(seg.blocks) for seg in model.layers] == [3, 1]
    with pytest.raises(ValueError, match=">= 1"):
        apply_activation_checkpointing(TransformerLM(SPEC), every=0)
    with pytest.raises(ValueError, match="ModuleList"):
        apply_activation_checkpointing(torch.nn.Linear(2, 2), every=1)


def test_old_module_name_reexports_the_same_public_names():
    """``torch_impl.checkpointing``, this module's old name, is kept for one release as a re-export."""
    import torch_impl.activation_checkpointing as new
    import torch_impl.checkpointing as old

    assert old.__all__ == new.__all__ and "apply_activation_checkpointing" in new.__all__
    for name in new.__all__:
        assert getattr(old, name) is getattr(new, name)
    from torch_impl.checkpointing import apply_activation_checkpointing as old_apply
    from torch_impl.parallelize import apply_activation_checkpointing as parallelize_apply
    assert old_apply is parallelize_apply is new.apply_activation_checkpointing


# ----------------------------------------------------------------------------- the attention kept (selective)


def _flash_model(seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(SPEC, attention="flash_triton")


def _count_attention_forwards(monkeypatch) -> list[int]:
    """The Triton forward's launches, counted (the kernels run under the interpreter on the CPU)."""
    import torch_impl.attention.flash_triton as flash

    calls = [0]
    launch = flash.flash_forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return launch(*args, **kwargs)

    monkeypatch.setattr(flash, "flash_forward", counted)
    return calls


@pytest.mark.parametrize("every,compiled,device", [
    (1, False, "cpu"), (3, False, "cpu"), (1, True, "cpu"),
    pytest.param(1, False, "cuda", marks=pytest.mark.gpu), pytest.param(2, True, "cuda", marks=pytest.mark.gpu)])
def test_kept_attention_gives_the_gradients_without_recomputing_the_attention(monkeypatch, every, compiled, device):
    from torch_impl.parallelize import apply_compile

    reference, model = _flash_model().to(device), _flash_model().to(device)
    apply_activation_checkpointing(model, every, keep_attention=True)
    if compiled:  # each block's forward alone, inside the eager segment (parallelize does this for kept attention)
        apply_compile(model, hooks_eager=True)
    calls = _count_attention_forwards(monkeypatch)
    for step in range(2):  # the second step starts from what the first kept being dropped
        tokens = torch.randint(0, SPEC.vocab_size, (2, 33), generator=torch.Generator().manual_seed(step)).to(device)
        for m in (reference, model):
            m.zero_grad(set_to_none=True)
            cross_entropy(m(tokens[:, :-1]), tokens[:, 1:]).backward()
        assert calls[0] == (step + 1) * 2 * SPEC.n_layers  # the reference's and the forward's: no recomputation
        expected = grads_by_block(reference)
        for key, grad in grads_by_block(model).items():
            torch.testing.assert_close(grad, expected[key], rtol=1e-5, atol=1e-6)


def test_kept_attention_holds_each_blocks_output_and_log_sum_exp_until_its_recomputation():
    model = apply_activation_checkpointing(_flash_model(), 3, keep_attention=True)
    tokens = torch.randint(0, SPEC.vocab_size, (2, 17))
    loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    kept = [outputs for segment in model.layers for _, outputs in segment.kept._kept]
    heads, d_head = SPEC.n_heads, SPEC.d_model // SPEC.n_heads
    assert [tuple(t.shape) for pair in kept for t in pair] == [(2, heads, 16, d_head), (2, heads, 16)] * SPEC.n_layers
    loss.backward()
    assert all(not segment.kept._kept for segment in model.layers)  # handed to the recomputation, then gone
    with torch.no_grad():  # nothing to recompute: nothing kept
        model(tokens[:, :-1])
    assert all(not segment.kept._kept for segment in model.layers)


def test_kept_attention_refuses_what_cannot_take_it():
    with pytest.raises(ValueError, match="flash_triton.*the model's is sdpa"):
        apply_activation_checkpointing(TransformerLM(SPEC, attention="sdpa"), 1, keep_attention=True)
    with pytest.raises(ValueError, match="nested"):
        apply_activation_checkpointing(_flash_model(), 2, nested=True, keep_attention=True)
    from torch_impl.activation_checkpointing import KeptAttention

    kept = KeptAttention()
    kept.take("shapes", lambda: (torch.zeros(2),))
    kept.recording = False
    with pytest.raises(RuntimeError, match="with other shapes, the forward with shapes"):
        kept.take("other shapes", lambda: (torch.zeros(2),))
    with pytest.raises(RuntimeError, match="more often"):
        kept.take("shapes", lambda: (torch.zeros(2),))

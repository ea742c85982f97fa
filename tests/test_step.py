"""The shared training step (``torch_impl.step.train_step``) and its phase timing.

The step over micro-batches must equal the plain single-process computation on their concatenation (float64,
fresh random weights and tokens), mark the shared phase names in order, and the timer must sum a phase marked
once per micro-batch.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from analysis.records import STEP_PHASES
from parallelism_calc.specs import MODELS
from torch_impl.distributed import SingleProcess
from torch_impl.model import TransformerLM, cross_entropy
from torch_impl.step import StepParts, train_step
from torch_impl.timing import PhaseTimer


def _model(seed: int) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(MODELS["tiny"].replace(n_layers=2), attention="sdpa").to(torch.float64)


@pytest.mark.parametrize("seed", [0, 1])
def test_accumulated_step_matches_one_plain_step_on_the_whole_batch(seed):
    ours, plain = _model(seed), _model(seed)
    tokens = torch.randint(0, ours.spec.vocab_size, (4, 17), generator=torch.Generator().manual_seed(seed))
    micro = [(t[:, :-1], t[:, 1:]) for t in tokens.split(2)]
    sgd = dict(lr=0.5)
    parts = StepParts(ours, torch.optim.SGD(ours.parameters(), **sgd), wrapper=SingleProcess(ours), grad_clip=1e9)
    marks = []
    loss, norm = train_step(parts, micro, marks.append)

    optimizer = torch.optim.SGD(plain.parameters(), **sgd)
    expected = cross_entropy(plain(tokens[:, :-1]), tokens[:, 1:])
    expected.backward()
    expected_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in plain.parameters()]))
    optimizer.step()

    assert marks == ["forward", "backward", "forward", "backward", "comm", "optimizer"]
    assert set(marks) == set(STEP_PHASES)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(norm.double(), expected_norm, rtol=1e-6, atol=0)  # the wrapper sums squares in fp32
    for (name, p), q in zip(ours.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=name)
        assert p.grad is None  # released after the step


def test_forward_mode_runs_without_gradients_and_forward_backward_leaves_the_weights():
    model = _model(2)
    before = [p.detach().clone() for p in model.parameters()]
    tokens = torch.randint(0, model.spec.vocab_size, (2, 9))
    parts = StepParts(model, torch.optim.SGD(model.parameters(), lr=1.0))
    marks = []
    train_step(parts, [(tokens[:, :-1], tokens[:, 1:])], marks.append, mode="forward")
    train_step(parts, [(tokens[:, :-1], tokens[:, 1:])], marks.append, mode="forward_backward")
    assert marks == ["forward", "forward", "backward"]
    assert all(torch.equal(p, b) and p.grad is None for p, b in zip(model.parameters(), before))
    with pytest.raises(ValueError, match="accepted: forward, forward_backward, train_step"):
        train_step(parts, [], mode="backward")
    with pytest.raises(ValueError, match="grad_clip needs the data-parallel wrapper"):
        StepParts(model, parts.optimizer, grad_clip=1.0)


def test_phase_timer_sums_a_phase_marked_once_per_micro_batch():
    timer = PhaseTimer(torch.device("cpu"))
    for _ in range(2):
        timer.start()
        for _ in range(3):
            time.sleep(0.002)
            timer.mark("forward")
        time.sleep(0.001)
        timer.mark("optimizer")
    steps, phases = timer.results()
    assert [len(v) for v in phases.values()] == [2, 2]
    for i, step in enumerate(steps):
        assert phases["forward"][i] >= 6
        assert step == pytest.approx(phases["forward"][i] + phases["optimizer"][i])


@pytest.mark.gpu
def test_trainer_with_the_blocks_cuda_graphs_trains_and_validates_like_without(tmp_path):
    """--cuda-graph blocks replays each compiled block: the same losses as the compiled blocks alone, and a
    validation pass (which runs the blocks eagerly: see ``torch_impl.train.evaluate``)."""
    from torch_impl.train import TrainConfig, run_training

    runs = {}
    for graph in ("off", "blocks"):
        torch._dynamo.reset()
        cfg = TrainConfig(model="tiny", batch_size=4, seq_len=32, steps_per_epoch=4, val_batches=2, compile=True,
                          cuda_graph=graph, device="cuda", cache_dir=str(tmp_path), builtin_mb=0.25, progress=False)
        runs[graph] = run_training(cfg)
    np.testing.assert_allclose(runs["blocks"].train_losses, runs["off"].train_losses, rtol=1e-5)
    np.testing.assert_allclose(runs["blocks"].val_losses, runs["off"].val_losses, rtol=1e-5)

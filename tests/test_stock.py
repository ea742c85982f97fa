"""The stock reference, the step harness's phase timing, regional compilation and the captured step.

The stock model (``torch_impl.stock``) must compute the same function as ours from the same weights: checked in
float64 on fresh random weights and tokens, logits and every gradient. The e2e benchmark times it in the same
process (``--stock``) and states ours as "x times stock"; its phases come from ``PhaseTimer`` marks.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from analysis.records import read_records
from parallelism_calc.specs import MODELS
from torch_impl.bench import e2e
from torch_impl.model import TransformerLM, cross_entropy
from torch_impl.optim import MasterAdamW
from torch_impl.parallelize import apply_compile, parallelize
from torch_impl.stock import StockTransformerLM
from torch_impl.timing import PhaseTimer, capture_step

FLAGS = ["--model", "tiny", "--batch-size", "2", "--seq-len", "16", "--warmup", "1", "--steps", "3",
         "--device", "cpu", "--attention", "sdpa"]


def _random_pair(seed: int, dtype=torch.float64):
    """Ours and the stock model with the same random weights (norm gains too), and random tokens."""
    spec = MODELS["tiny"].replace(n_layers=3)
    torch.manual_seed(seed)
    ours = TransformerLM(spec, attention="sdpa").to(dtype)
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.1 * torch.randn_like(p))  # norm gains away from 1
    stock = StockTransformerLM(spec, attention="sdpa").to(dtype)
    stock.load_state_dict(ours.state_dict())
    tokens = torch.randint(0, spec.vocab_size, (3, 20))
    return ours, stock, tokens


def test_stock_model_computes_our_function():
    seed = int(np.random.SeedSequence().entropy % 10_000)
    ours, stock, tokens = _random_pair(seed)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in stock.named_parameters()]
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits = [model(inputs) for model in (ours, stock)]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-6, atol=1e-9)  # tables are fp32 in both
    for model, out in zip((ours, stock), logits):
        cross_entropy(out, targets).backward()
    for (name, p), q in zip(ours.named_parameters(), stock.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-9, msg=name)


def test_stock_model_accepts_sdpa_backends_only():
    with pytest.raises(ValueError, match="accepted: sdpa, sdpa_cudnn"):
        StockTransformerLM(MODELS["tiny"], attention="flash_triton")


def _logits_and_grads(model, tokens, forward=None):
    """The logits of ``forward`` (default the model) on tokens[:, :-1] and every gradient of their loss."""
    model.zero_grad()
    logits = (forward or model)(tokens[:, :-1])
    cross_entropy(logits, tokens[:, 1:]).backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("blocks_per_graph, options", [(1, {"triton.mix_order_reduction": False}), (2, None),
                                                      (4, None)])
def test_regional_compilation_keeps_names_and_function(blocks_per_graph, options):
    """Each block, or spans of blocks (3 blocks in spans of 2: the last span shorter), compiled: the parameter names,
    logits and gradients of the eager model, from one graph per span length."""
    ours, _, tokens = _random_pair(int(np.random.SeedSequence().entropy % 10_000), dtype=torch.float32)
    names = [n for n, _ in ours.named_parameters()]
    expected = _logits_and_grads(ours, tokens)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    apply_compile(ours, options=options, blocks_per_graph=blocks_per_graph)
    assert [n for n, _ in ours.named_parameters()] == names
    torch.testing.assert_close(_logits_and_grads(ours, tokens), expected, rtol=1e-4, atol=1e-5)
    n_blocks = len(ours.layers)
    span_lengths = {min(blocks_per_graph, n_blocks - i) for i in range(0, n_blocks, blocks_per_graph)}
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == len(span_lengths)


def test_parallelize_checkpoints_then_compiles_then_wraps():
    """``parallelize``: activation checkpointing, then compilation (of the checkpointed segments), then the wrapper
    with its AdamW, computing the eager model's logits and gradients; what cannot go together is refused."""
    ours, _, tokens = _random_pair(int(np.random.SeedSequence().entropy % 10_000), dtype=torch.float32)
    expected = _logits_and_grads(ours, tokens)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    forward, wrapper, optimizer = parallelize(ours, "none", adamw={"lr": 1e-3, "fused": False}, compile=True,
                                              ac_every=2)
    assert [len(segment.blocks) for segment in ours.layers] == [2, 1]
    torch.testing.assert_close(_logits_and_grads(ours, tokens, forward), expected, rtol=1e-4, atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # compiled, not eager
    assert wrapper.module is ours and isinstance(optimizer, torch.optim.AdamW)
    assert {id(p) for group in optimizer.param_groups for p in group["params"]} == {id(p) for p in ours.parameters()}
    with pytest.raises(ValueError, match="--cuda-graph blocks with --dist fsdp: their gathered weights"):
        parallelize(TransformerLM(MODELS["tiny"], attention="sdpa"), "fsdp", adamw={}, compile=True, cuda_graphs=True)
    with pytest.raises(ValueError, match="need compile=True"):
        parallelize(TransformerLM(MODELS["tiny"], attention="sdpa"), adamw={}, cuda_graphs=True)


def test_regional_compilation_refuses_what_it_cannot_compile():
    with pytest.raises(ValueError, match="ModuleList of blocks"):
        apply_compile(torch.nn.Linear(2, 2))
    _, stock, _ = _random_pair(0)
    with pytest.raises(ValueError, match="blocks_per_graph=2: accepted 1, or more where model.layers is"):
        apply_compile(stock, blocks_per_graph=2)  # the stock model loops over its blocks itself
    with pytest.raises(ValueError, match="blocks_per_graph=0"):
        apply_compile(TransformerLM(MODELS["tiny"], attention="sdpa"), blocks_per_graph=0)


def test_phase_timer_marks_add_up_to_the_step():
    timer = PhaseTimer(torch.device("cpu"))
    for _ in range(3):
        timer.start()
        time.sleep(0.004)
        timer.mark("forward")
        time.sleep(0.008)
        timer.mark("backward")
    steps, phases = timer.results()
    assert len(steps) == 3 and set(phases) == {"forward", "backward"}
    for i, step in enumerate(steps):
        assert step == pytest.approx(phases["forward"][i] + phases["backward"][i])
        assert phases["forward"][i] >= 4 and phases["backward"][i] >= 8


def test_e2e_times_stock_then_ours_in_one_process(tmp_path):
    out = tmp_path / "runs.jsonl"
    assert e2e.main([*FLAGS, "--stock", "sdpa", "--out", str(out)]) == 0
    stock, ours = read_records(out)
    assert (stock.implementation, ours.implementation) == ("stock eager sdpa", "eager sdpa")
    assert ours.metrics["x_stock"] == pytest.approx(stock.timing["median_ms"] / ours.timing["median_ms"])
    assert "x_stock" not in stock.metrics
    # Same weights, same batch, same function: the same losses, step after step.
    np.testing.assert_allclose(ours.metrics["losses"], stock.metrics["losses"], rtol=1e-5)
    for record in (stock, ours):
        assert set(record.phases) == {"forward", "backward", "optimizer"} and record.timed_steps == 3


def test_e2e_writes_each_record_as_soon_as_it_is_measured(tmp_path, monkeypatch):
    """Stock's record is on disk before ours is measured: an interruption then loses only what was not done."""
    out, measured = tmp_path / "runs.jsonl", e2e._measure

    def interrupted_after_stock(args, stock, graph):
        if not stock:
            assert [r.implementation for r in read_records(out)] == ["stock eager sdpa"]
            raise KeyboardInterrupt
        return measured(args, stock, graph)

    monkeypatch.setattr(e2e, "_measure", interrupted_after_stock)
    with pytest.raises(KeyboardInterrupt):
        e2e.main([*FLAGS, "--stock", "sdpa", "--out", str(out)])
    assert len(read_records(out)) == 1


def test_e2e_bf16_mixed_trains_like_autocast_beside_stock(tmp_path):
    """Ours with bf16 weights and fp32 masters (MasterAdamW) beside the stock model under autocast: same start,
    and the losses stay within bf16 rounding of each other (the residual stream is bf16 in ours)."""
    out = tmp_path / "runs.jsonl"
    assert e2e.main([*FLAGS, "--dtype", "bf16_mixed", "--stock", "sdpa", "--out", str(out)]) == 0
    stock, ours = read_records(out)
    assert (stock.dtype, ours.dtype) == ("bf16", "bf16_mixed")
    assert (stock.metrics["optimizer"], ours.metrics["optimizer"]) == ("AdamW", "MasterAdamW")
    np.testing.assert_allclose(ours.metrics["losses"], stock.metrics["losses"], rtol=2e-2)
    assert ours.metrics["loss_last"] < ours.metrics["loss_first"] - 0.1


@pytest.mark.parametrize("argv,message", [
    (["--stock", "flash_triton"], "the stock model runs SDPA; accepted: sdpa, sdpa_cudnn"),
    (["--cuda-graph", "step"], "--cuda-graph step replays CUDA graphs: it needs --device cuda"),
    (["--cuda-graph", "on"], "a comma-separated list of distinct modes from off, blocks, step"),
    (["--cuda-graph", "off,off"], "a comma-separated list of distinct modes from off, blocks, step"),
    (["--cuda-graph", "blocks"], "--cuda-graph blocks replays the graphs of the compiled blocks: it needs --compile"),
    (["--cuda-graph", "off,blocks", "--compile", "--checkpoint-every", "1"], "not with --ac-every"),
])
def test_e2e_rejects_bad_stock_and_graph_flags(argv, message):
    with pytest.raises(SystemExit, match=message):
        e2e.main([*FLAGS, *argv])


def tiny_training(compiled: bool = False, cuda_graphs: bool = False, capturable: bool = False,
                  master: bool = False):
    """A tiny model on the GPU (blocks compiled if ``compiled``, with CUDA graph trees if ``cuda_graphs``), its
    AdamW (``MasterAdamW`` over bf16 weights if ``master``) and a fixed batch: returns the optimizer and
    ``step()``, one train step returning the detached loss."""
    spec = MODELS["tiny"]
    generator = torch.Generator("cuda").manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (2, 33), device="cuda", generator=generator)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TransformerLM(spec, attention="sdpa", device="cuda")
    optimizer = (MasterAdamW(model.parameters(), lr=1e-3) if master else  # before compiling: it casts the weights
                 torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=capturable))
    if compiled:
        apply_compile(model, cuda_graphs=cuda_graphs)

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        optimizer.step()
        return loss.detach()

    return optimizer, step


@pytest.mark.gpu
@pytest.mark.parametrize("master", [False, True], ids=["adamw", "master_adamw"])
def test_captured_step_trains_like_the_eager_step(master):
    """A replayed CUDA graph of forward + backward + AdamW gives the eager step's losses, step after step (with
    MasterAdamW too: its gradient-address table is uploaded inside the capture)."""
    _, step = tiny_training(master=master)
    eager = [step().item() for _ in range(6)]  # the first two: the captured run's warm-up steps
    optimizer, step = tiny_training(capturable=True, master=master)
    replay = capture_step(step, optimizer, warmup=2)
    np.testing.assert_allclose([replay().item() for _ in range(4)], eager[2:], rtol=1e-4)


@pytest.mark.gpu
def test_block_cuda_graphs_train_like_the_compiled_blocks():
    """Blocks compiled with CUDA graph trees (warm-up, recording, then replays) give the compiled blocks' losses."""
    _, step = tiny_training(compiled=True)
    compiled = [step().item() for _ in range(5)]
    _, step = tiny_training(compiled=True, cuda_graphs=True)
    np.testing.assert_allclose([step().item() for _ in range(5)], compiled, rtol=1e-4)

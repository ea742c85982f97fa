"""The calculator's stage-3 working set (``parallelism_calc.memory.per_device_memory``'s ``gathered`` and
``cast_weights``) against what our ``FSDP`` and torch FSDP2 really hold, on 2 gloo ranks with the tiny model.

Our FSDP, with its default units of a block (``gather_unit="block"``, ``prefetch_layers=1``) and one weight per
unit (``"layer"``, 2 prefetched): its measured ``peak_gathered_bytes`` after one forward + backward, in fp32 and
with ``compute_dtype=bfloat16``, once gloo's transient reference is taken out, equals the peak derived by hand from
FSDP's prefetch logic and is at most the calculator's ``gathered``; with gloo's own buffers, at most one finished
gather more per gloo worker thread.
Under autocast, bf16 gathers leave no bf16 weight copy saved for backward (``cast_weights`` = 0), while fp32
gathers (the negative control) save exactly the copies the calculator counts for ZeRO-1/2.

FSDP2 (``fully_shard`` per block, then the root, ``MixedPrecisionPolicy(param_dtype=bfloat16)`` under
autocast: ``torch_impl.parallelize.apply_data_parallel(..., "fsdp2", dtype="bf16")``): the root's parameters stay
unsharded from the forward to the end of the backward while blocks are unsharded one at a time (``reshard_root=False``).

Our FSDP's gradient reduce-scatters (``per_device_memory``'s ``pending_reduce_scatters``, ``ReduceScatterQueue``): the
bytes its ``_pending_grads`` hold at each block's backward and at each launch, on a 4-block tiny model, are the
calculator's queue to the norm gains (replicated by our FSDP, counted in the calculator's block unit).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from parallelism_calc.memory import per_device_memory, reduce_scatter_queue
from parallelism_calc.specs import MODELS
from tests._dist import run_ranks

TINY = MODELS["tiny"]  # D 64, F 176, V 512, 2 layers
D, F, V = TINY.d_model, TINY.d_ff, TINY.vocab_size
WORLD = 2
BATCH, SEQ = 2, 16  # B x T = 32 rows: no activation is shaped like a weight (64, 176 or 512 rows)
BYTES = {"fp32": 4, "bf16": 2}


def _padded(numel: int) -> int:
    """FSDP pads each flattened weight to a multiple of the world size before splitting it."""
    return math.ceil(numel / WORLD) * WORLD


def _step(fsdp, autocast: bool = False) -> None:
    from torch_impl.model import cross_entropy

    tokens = torch.randint(V, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = cross_entropy(fsdp(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    fsdp.finish_gradient_synchronization()


def _wrap(compute_dtype, gather_unit: str = "block"):
    from torch_impl.distributed import FSDP
    from torch_impl.model import TransformerLM

    torch.manual_seed(0)
    return FSDP(TransformerLM(TINY), compute_dtype=compute_dtype, gather_unit=gather_unit)  # default prefetch


class _ScratchGather:
    """The all-gather lands in a scratch tensor, copied into FSDP's buffer on ``wait()``: gloo's worker
    thread, which holds a finished collective's output a moment after ``wait()`` returns, then never holds
    FSDP's buffer, so ``gathered_bytes()`` counts exactly what FSDP and autograd keep."""

    def __init__(self, real):
        self.real = real

    def __call__(self, out, inp, group=None, async_op=False):
        scratch = torch.empty_like(out)
        work = self.real(scratch, inp, group=group, async_op=async_op)
        if not async_op:
            out.copy_(scratch)
            return work
        return _CopyOnWait(work, out, scratch)


class _CopyOnWait:
    def __init__(self, work, out, scratch):
        self.work, self.out, self.scratch = work, out, scratch

    def wait(self):
        self.work.wait()
        self.out.copy_(self.scratch)
        self.scratch = None
        return True


def _weight_copies_saved(compute_dtype) -> int:
    """Bytes of the bf16 tensors shaped like a Linear weight (its transpose, q, k and v's concatenated) that autograd
    saves as plain tensors (FSDP's pack hook replaces views of its gathered weights by a re-gather recipe) in a
    forward under autocast: autocast's weight copies. Unique storages."""
    fsdp = _wrap(compute_dtype)
    shapes = {tuple(w.shape) for w in fsdp._weights} | {tuple(w.shape)[::-1] for w in fsdp._weights}
    shapes.add((3 * TINY.d_model, TINY.d_model))  # the q, k, v product's one weight copy (torch_impl.qkv_projection)
    copies: dict[int, int] = {}
    pack = fsdp._pack

    def recording_pack(tensor):
        packed = pack(tensor)
        if packed is tensor and tensor.dtype == torch.bfloat16 and tuple(tensor.shape) in shapes:
            storage = tensor.untyped_storage()
            copies[storage.data_ptr()] = storage.nbytes()
        return packed

    fsdp._pack = recording_pack
    _step(fsdp, autocast=True)
    return sum(copies.values())


def _gloo_threads() -> int:
    """gloo's worker threads in the default group (``options.threads``, 2 by default): each runs one collective at
    a time and keeps it, and so its output, until it gets the CPU back after waking ``wait()``."""
    backend = torch.distributed.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    return getattr(getattr(backend, "options", None), "_threads", 2)


def _ours_body(rank: int, world_size: int) -> dict:
    import torch_impl.distributed.fsdp as fsdp_module

    out = {}
    units = [(unit, name, dtype) for unit in ("layer", "block") for name, dtype in (("fp32", None),
                                                                                   ("bf16", torch.bfloat16))]
    for unit, name, dtype in units:
        fsdp = _wrap(dtype, unit)
        _step(fsdp)
        out[f"peak_{unit}_{name}"] = fsdp.peak_gathered_bytes
    real = fsdp_module._all_gather_flat
    fsdp_module._all_gather_flat = _ScratchGather(real)
    try:
        for unit, name, dtype in units:
            fsdp = _wrap(dtype, unit)
            _step(fsdp)
            out[f"settled_{unit}_{name}"] = fsdp.peak_gathered_bytes
    finally:
        fsdp_module._all_gather_flat = real
    out["gloo_threads"] = _gloo_threads()
    out["copies_bf16_gather"] = _weight_copies_saved(torch.bfloat16)
    out["copies_fp32_gather"] = _weight_copies_saved(None)
    return out


def _check_peaks(res: dict, unit: str, name: str, exact: int, calc_gathered: float, largest_unit: int) -> None:
    """What FSDP keeps, with gloo's transient reference taken out (_ScratchGather), is exactly ``exact`` and
    within the calculator's bound. Measured with gloo's own buffers: at least that (the instant happens on every
    run) and at most one finished gather more per gloo worker thread: a worker keeps the work it ran, and so its
    output, until it gets the CPU back after waking ``wait()`` (seen: an F D matrix, a whole block: 3 blocks'
    weights on one rank of one CI run, and both threads at once: 3 blocks + the V D embedding, 366,592 bytes in
    bf16, on a loaded CI machine)."""
    settled, peak = res[f"settled_{unit}_{name}"], res[f"peak_{unit}_{name}"]
    assert settled == exact <= calc_gathered, (unit, name, res)
    assert exact <= peak <= exact + res["gloo_threads"] * largest_unit, (unit, name, res)


def test_our_fsdp_peak_gathered_against_the_calculator():
    results = run_ranks(_ours_body, WORLD, timeout_s=90)
    for name in ("fp32", "bf16"):
        precision = "fp32" if name == "fp32" else "bf16_autocast"  # gathers in 4 / 2 bytes
        calc = per_device_memory(TINY, "fsdp", WORLD, WORLD * BATCH * SEQ, SEQ, precision,
                                 gather_unit="layer", prefetch_layers=2)
        # FSDP's peak, from its prefetch logic: a layer starts its own gather and those of the next 2 layers in
        # execution order (forward: embedding, then q, k, v, o, w1, w3, w2 per block, then the LM head;
        # backward: the reverse of the layers that saved their weight, the embedding excluded), and frees
        # each gathered weight after its layer is done. The largest 3 neighbours are the last block's w3 and
        # w2 and the LM head (forward: w3 prefetches the LM head while w2 is pending; backward: the LM head
        # prefetches w2 and w3): V D + 2 F D. (The first forward, prefetching in registration order w1, w2,
        # w3, briefly holds 4 layers, w2 w3 q k = 2 F D + 2 D^2, which is less.)
        exact = (_padded(V * D) + 2 * _padded(F * D)) * BYTES[name]
        assert exact == {"fp32": 221_184, "bf16": 110_592}[name]
        # The calculator's bound: 3 x the largest matrix (the 512 x 64 embedding / LM head): 0.56 x above it.
        assert calc.gathered == 3 * V * D * BYTES[name] and calc.cast_weights == 0
        for rank, res in enumerate(results):
            _check_peaks(res, "layer", name, exact, calc.gathered, largest_unit=_padded(V * D) * BYTES[name])
        # Units of a block, one prefetched: a block's weights B = 4 D^2 + 3 D F are the largest unit (the
        # embedding and the LM head, V D each, are units of their own). Whenever a unit is taken, the one before
        # it is freed (its forward's post-hook, or in the backward its _GatherUnit node, which autograd runs
        # after every node of the block), so the peak is the rank-major buffer of a block and its copy-out, or a
        # block in use and the next one prefetched: 2 B, against the calculator's 2 x (B + its 2 D norm gains).
        calc_block = per_device_memory(TINY, "fsdp", WORLD, WORLD * BATCH * SEQ, SEQ, precision,
                                       gather_unit="block", prefetch_layers=1)
        exact = 2 * (4 * D * D + 3 * D * F) * BYTES[name]
        assert calc_block.gathered == 2 * (4 * D * D + 3 * D * F + 2 * D) * BYTES[name]
        for res in results:
            _check_peaks(res, "block", name, exact, calc_block.gathered, largest_unit=exact // 2)
    # Autocast over bf16 gathers: autocast's cast of a bf16 weight is a no-op, so no weight copy is saved for
    # backward, as the calculator's stage 3 says. Negative control, fp32 gathers under autocast: every matmul
    # weight's bf16 copy is saved, exactly the calculator's cast_weights for a strategy reading fp32 weights.
    zero2 = per_device_memory(TINY, "zero2", WORLD, WORLD * BATCH * SEQ, SEQ, "bf16_autocast")
    assert zero2.cast_weights == (2 * (4 * D * D + 3 * D * F) + D * V) * 2
    for rank, res in enumerate(results):
        assert res["copies_bf16_gather"] == 0, (rank, res)
        assert res["copies_fp32_gather"] == zero2.cast_weights, (rank, res)


def _unsharded_bytes(model) -> tuple[int, frozenset[str]]:
    """Bytes of the parameters FSDP2 has unsharded now (registered as plain tensors, not DTensors), and the
    top-level owners ("root" or "layers.i") they belong to."""
    from torch.distributed.tensor import DTensor

    total, owners = 0, set()
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor):
            total += param.numel() * param.element_size()
            owners.add(".".join(name.split(".")[:2]) if name.startswith("layers.") else "root")
    return total, frozenset(owners)


def _fsdp2_body(rank: int, world_size: int) -> dict:
    import warnings

    from torch_impl.model import Linear, TransformerLM, cross_entropy
    from torch_impl.parallelize import apply_data_parallel

    torch.manual_seed(0)
    model, _, _ = apply_data_parallel(TransformerLM(TINY), "fsdp2", dtype="bf16", adamw={})
    samples = []  # (phase, bytes, owners) at each Linear's forward and at each saved tensor's unpack
    for module in model.modules():
        if isinstance(module, Linear):
            module.register_forward_pre_hook(lambda *_: samples.append(("fwd", *_unsharded_bytes(model))))

    def unpack(saved):
        samples.append(("bwd", *_unsharded_bytes(model)))
        return saved

    tokens = torch.randint(V, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP2 warns that the root returns a view; we do not modify it
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
            after_forward = _unsharded_bytes(model)
            loss.backward()
    return {"samples": samples, "after_forward": after_forward, "after_backward": _unsharded_bytes(model)}


def test_fsdp2_keeps_its_root_gathered_and_blocks_one_at_a_time():
    results = run_ranks(_fsdp2_body, WORLD, timeout_s=90)
    root = (V * D + D + D * V) * 2  # embedding, final norm gain, LM head, in bf16
    block = (4 * D * D + 3 * D * F + 2 * D) * 2  # q, k, v, o, W1, W2, W3 and 2 norm gains, in bf16
    calc = per_device_memory(TINY, "fsdp", WORLD, WORLD * BATCH * SEQ, SEQ, "bf16_autocast",
                             gather_unit="block", prefetch_layers=1, reshard_root=False)
    assert calc.gathered == root + 2 * block and calc.cast_weights == 0
    for rank, res in enumerate(results):
        samples = res["samples"]
        assert {phase for phase, _, _ in samples} == {"fwd", "bwd"}
        for phase, nbytes, owners in samples:
            # The root is unsharded throughout, next to at most one block (the one computing).
            assert "root" in owners and len(owners) <= 2, (rank, phase, owners)
            assert nbytes == root + block * (len(owners) - 1), (rank, phase, nbytes, owners)
        assert {o for _, _, owners in samples for o in owners} == {"root", "layers.0", "layers.1"}
        assert res["after_forward"] == (root, frozenset({"root"}))  # not resharded after forward
        assert res["after_backward"] == (0, frozenset())  # resharded at the end of the backward
        # Measured peak: the root + 1 block. The calculator's second block is the gather prefetched ahead,
        # which lands in FSDP2's all-gather buffer (not yet a registered parameter) while one block computes.
        peak = max(nbytes for _, nbytes, _ in samples)
        assert peak == root + block == calc.gathered - block


TINY4 = dataclasses.replace(TINY, name="tiny4", n_layers=4)  # 4 blocks: 2 reduce-scatters in flight, then steady


def _reduce_scatter_body(rank: int, world_size: int, compute_dtype) -> dict:
    """Bytes our FSDP's reduce-scatters in flight hold (``_pending_grads``: each unit's rank-major ``flat`` and its
    ``piece``) when each block's backward starts (the gradient of the block's output is complete) and when each
    unit's reduce-scatter is launched (the new ``flat`` and ``piece`` beside those still in flight)."""
    import torch_impl.distributed.fsdp as fsdp_module
    from torch_impl.distributed import FSDP
    from torch_impl.model import TransformerLM, cross_entropy

    torch.manual_seed(0)
    fsdp = FSDP(TransformerLM(TINY4), compute_dtype=compute_dtype)

    def held() -> int:
        return sum(piece.nbytes + flat.nbytes for _, piece, _, flat in fsdp._pending_grads)

    starts, launches = [], []

    def on_output_gradient(module, args, out) -> None:
        out.register_hook(lambda grad: starts.append(held()))

    for block in fsdp.module.layers:
        block.register_forward_hook(on_output_gradient)
    real = fsdp_module._reduce_scatter_flat

    def launching(piece, flat, *args, **kwargs):
        launches.append(held() + piece.nbytes + flat.nbytes)
        return real(piece, flat, *args, **kwargs)

    fsdp_module._reduce_scatter_flat = launching
    try:
        tokens = torch.randint(V, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
        cross_entropy(fsdp(tokens[:, :-1]), tokens[:, 1:]).backward()
        at_end = held()
        fsdp.finish_gradient_synchronization()
    finally:
        fsdp_module._reduce_scatter_flat = real
    return {"starts": starts, "launches": launches, "at_end": at_end}


@pytest.mark.parametrize("compute_dtype, precision", [(None, "fp32"), (torch.bfloat16, "bf16_autocast")])
def test_our_fsdp_reduce_scatters_in_flight_against_the_calculator(compute_dtype, precision):
    """Units in the backward's order: the LM head (V D), blocks 3 .. 0 (B = 4 D^2 + 3 D F each), the embedding; each
    in flight holds its input and its output piece, u p (1 + 1 / 2); at most 2 in flight between launches, 3 as one
    is launched (the oldest lands after). So a block's backward starts with the last 2 units launched before it (the
    head alone at block 3), not with the unit's own gradient and 3 reduce-scatters (the formula before, 5.5 u p at
    every moment of the backward); that is where the calculator's timeline puts them, with B + its 2 D norm gains."""
    p = 4 if compute_dtype is None else 2
    head, block = V * D, 4 * D * D + 3 * D * F
    r = p * (1 + 1 / WORLD)  # bytes a parameter in flight
    starts = [head, head + block, 2 * block, 2 * block]  # blocks 3, 2, 1, 0
    launches = [head, head + block, head + 2 * block, 3 * block, 3 * block, 2 * block + head]  # head .. embedding
    results = run_ranks(_reduce_scatter_body, WORLD, compute_dtype, timeout_s=90)
    for rank, res in enumerate(results):
        assert res["starts"] == [n * r for n in starts], (rank, res)
        assert res["launches"] == [n * r for n in launches], (rank, res)
        assert res["at_end"] == (block + head) * r, (rank, res)  # the last 2, landed by finish_gradient_sync...
    queue = reduce_scatter_queue(TINY4, 2, WORLD, precision)
    gains = 2 * D  # a block's norm gains: in the calculator's block unit, replicated by our FSDP
    calc_starts = [queue.after(queue.first_block + j)[0] for j in range(4)]
    calc_launches = [queue.after(j, launching=True)[0] for j in range(1, len(queue.units) + 1)]
    assert calc_starts == pytest.approx([(n + gains * (n // block)) * r for n in starts], rel=1e-12)
    assert calc_launches == pytest.approx([(n + gains * (n // block)) * r for n in launches], rel=1e-12)
    for measured, calc in zip(res["starts"] + res["launches"], calc_starts + calc_launches):
        assert measured <= calc <= measured * (1 + gains / block)
    # per_device_memory: the "sum" model adds the most ever in flight (3 blocks, as one is launched); the timeline's
    # peak holds what the queue holds at that moment.
    kw = dict(gather_unit="block", prefetch_layers=1, pending_reduce_scatters=2, compute_dtype_stream=True)
    total = per_device_memory(TINY4, "fsdp", WORLD, WORLD * BATCH * SEQ, SEQ, precision, **kw)
    assert total.reduce_scatter == pytest.approx(max(res["launches"]), rel=gains / block)
    timeline = per_device_memory(TINY4, "fsdp", WORLD, WORLD * BATCH * SEQ, SEQ, precision, **kw,
                                 peak_model="timeline")
    moments = {**{f"backward, block {3 - j}": calc for j, calc in enumerate(calc_starts)},
               **{f"backward, block {3 - j}'s reduce-scatter": calc_launches[1 + j] for j in range(4)},
               "backward's end": calc_launches[-1], "forward's end": 0.0, "loss backward": 0.0}
    assert timeline.reduce_scatter == moments[timeline.peak_at], timeline.peak_at

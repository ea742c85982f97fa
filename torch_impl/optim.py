"""AdamW with fp32 master weights for bf16 parameters, every tensor of a parameter group updated by one kernel.

Mixed precision as Megatron-LM and ZeRO train (Micikevicius et al. 2018, "Mixed Precision Training"; Rajbhandari
et al. 2020, "ZeRO", section 3; the calculator's precision ``bf16_mixed``): the model's parameters, and so its
activations and gradients, are bf16, so forward and backward run without ``torch.autocast``'s casts of every
weight on every step; the optimizer keeps each weight's fp32 copy (the master) and both AdamW moments
(Loshchilov & Hutter 2019) in three flat fp32 buffers. One Triton launch per parameter group reads each bf16
gradient where autograd left it, updates master, exp_avg and exp_avg_sq in fp32 and writes the rounded weight
back into the bf16 parameter: 28 bytes of traffic per parameter, as many as torch's fused fp32 AdamW, and the
model's weight casts (forward) and gradient casts (backward) are gone.

How one launch finds every tensor (PyTorch's ``multi_tensor_apply`` does the same with kernel arguments): each
tensor is cut into chunks of ``BLOCK`` elements, a table fixed at construction maps each program to its tensor
and chunk, and the tensors' addresses sit in int64 tables that the kernel casts back to pointers (as Triton's
grouped-GEMM tutorial does). The gradients' table is refreshed only when autograd hands out gradients at new
addresses, which in steady state it does not.

Data parallelism without a mean kernel: a part of the gradients (``Part``) may come as each parameter's gradient on
every rank (``DDPBucketed(mean="optimizer")`` gathers them by peer copies); the kernel then loads them all and
averages them as ``mean_of`` does, rounded once to the gradients' dtype, so the update is the one it would make of a
gradient averaged in place, bit for bit, for 2 more bytes read a parameter and a peer.

Caveats: the step count is one device tensor per group (bias correction stays right in a captured CUDA graph, as
in torch's ``capturable`` AdamW), but a captured step replays with the learning rate it was captured with; a
parameter whose gradient is None is skipped (no decay, moments kept), but its group's step count still advances.
Without CUDA and without the Triton interpreter the same update runs as PyTorch ops on the flat buffers.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

BLOCK = 4096  # elements per program: 16 KiB of each fp32 stream, enough in flight to saturate HBM
ALIGN = 16  # elements: every tensor starts at a multiple (flat buffers padded so; allocations are aligned)
PARAM_DTYPES = {torch.bfloat16: tl.bfloat16}  # fp16 would need loss scaling, which this optimizer does not do


class Part(NamedTuple):
    """Gradients that land together (a data-parallel wrapper's ``finish_in_parts``): ``ready()`` makes the current
    stream wait for the gradients of ``params``; ``terms``: None where each ``.grad`` holds the averaged gradient,
    else for each parameter its gradient on every rank in rank order (its ``.grad`` among them, same shape and
    dtype), of which the averaged gradient is ``mean_of``."""

    params: list[torch.Tensor]
    ready: Callable[[], None]
    terms: list[list[torch.Tensor]] | None = None


def mean_of(terms: list[torch.Tensor]) -> torch.Tensor:
    """A gradient averaged over the ranks from its values on each (``Part.terms``), the same bits on every rank: the
    sum in fp32 (fp64 for fp64 values) in rank order, times 1 / N, rounded once to their dtype (on 2 ranks of bf16
    values NCCL's AVG and ``copy_engines.PeerAverage`` leave the same; ``MasterAdamW``'s kernel folds this into its
    load)."""
    exact = torch.promote_types(terms[0].dtype, torch.float32)
    total = terms[0].to(exact)
    for term in terms[1:]:
        total = total + term.to(exact)
    return (total * (1 / len(terms))).to(terms[0].dtype)


@triton.jit
def _load(ptrs, offs, n, FULL: tl.constexpr):
    """*ptrs as fp32, masked where offs >= n unless FULL (a whole chunk: no mask, so the loads vectorize)."""
    if FULL:
        return tl.load(ptrs).to(tl.float32)
    return tl.load(ptrs, mask=offs < n, other=0.0).to(tl.float32)


@triton.jit
def _store(ptrs, value, offs, n, FULL: tl.constexpr):
    if FULL:
        tl.store(ptrs, value)
    else:
        tl.store(ptrs, value, mask=offs < n)


@triton.jit
def _adamw_master_kernel(chunk_tensor, chunk_start, numels, flat_offsets, param_addrs, grad_addrs, n_tensors,
                         master, exp_avg, exp_avg_sq, step_ptr, lr, beta1, beta2, log2_beta1, log2_beta2,
                         eps, decay, PARAM_DTYPE: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr,
                         FULL: tl.constexpr, TERMS: tl.constexpr):
    """One chunk of one tensor: AdamW on the fp32 master, moments in fp32, the bf16 weight written back.
    ``FULL``: every chunk of this launch is whole (no masks); else each is a tensor's last, partial chunk.
    ``TERMS`` > 1: the gradient is ``mean_of`` the tensors at rows 0 ... TERMS - 1 of ``grad_addrs`` (rows of
    ``n_tensors``). ``decay``: 1 - lr weight_decay. Every product that is added is an explicit ``fma``, so the
    compiler has none left to contract its own way: the update's bits do not depend on ``TERMS`` (they did, in the
    masters' last bits on an H200, with the contraction the compiler chose), and it costs one division an element
    (the 1 / sqrt(bias correction) is one per program)."""
    chunk = tl.program_id(0)
    t = tl.load(chunk_tensor + chunk)
    grad_addr = tl.load(grad_addrs + t)
    if grad_addr != 0:  # address 0: no gradient, leave the tensor alone
        n = tl.load(numels + t)
        offs = tl.multiple_of(tl.load(chunk_start + chunk), BLOCK) + tl.arange(0, BLOCK)  # within tensor t
        flat = tl.multiple_of(tl.load(flat_offsets + t), ALIGN) + offs  # int64: flat buffers outgrow int32
        # the allocator aligns every tensor to at least ALIGN elements: say so, so that accesses vectorize
        grad = tl.multiple_of(grad_addr.to(tl.pointer_type(PARAM_DTYPE)), ALIGN)
        param = tl.multiple_of(tl.load(param_addrs + t).to(tl.pointer_type(PARAM_DTYPE)), ALIGN)
        g = _load(grad + offs, offs, n, FULL)
        if TERMS > 1:  # mean_of: summed in fp32 in rank order, times 1 / N, rounded to the gradients' dtype
            for j in tl.static_range(1, TERMS):
                term = tl.load(grad_addrs + j * n_tensors + t).to(tl.pointer_type(PARAM_DTYPE))
                g += _load(tl.multiple_of(term, ALIGN) + offs, offs, n, FULL)
            g = (g * (1.0 / TERMS)).to(PARAM_DTYPE, fp_downcast_rounding="rtne").to(tl.float32)
        w = _load(master + flat, offs, n, FULL)
        m = _load(exp_avg + flat, offs, n, FULL)
        v = _load(exp_avg_sq + flat, offs, n, FULL)
        step = tl.load(step_ptr)
        neg_step_size = -lr / (1.0 - tl.exp2(step * log2_beta1))  # -lr / (1 - beta1 ** step)
        root_correction = 1.0 / tl.sqrt(1.0 - tl.exp2(step * log2_beta2))  # 1 / sqrt(1 - beta2 ** step)
        m = tl.fma(m, beta1, (1.0 - beta1) * g)
        v = tl.fma(v, beta2, (1.0 - beta2) * g * g)
        w = tl.fma(w, decay, neg_step_size * m / tl.fma(tl.sqrt(v), root_correction, eps))
        _store(master + flat, w, offs, n, FULL)
        _store(exp_avg + flat, m, offs, n, FULL)
        _store(exp_avg_sq + flat, v, offs, n, FULL)
        _store(param + offs, w.to(PARAM_DTYPE, fp_downcast_rounding="rtne"), offs, n, FULL)


def check_tensors(params: list[torch.Tensor], grads: list[torch.Tensor | None], kernel: bool) -> None:
    """ValueError unless each gradient that is not None matches its parameter and, for the ``kernel``, each
    tensor is contiguous and starts at a multiple of ``ALIGN`` elements (so that its accesses vectorize)."""
    for p, g in zip(params, grads):
        for tensor, what in ((p, "parameter"), (g, "gradient")):
            alignment = ALIGN * p.element_size()
            if kernel and tensor is not None and (not tensor.is_contiguous() or tensor.data_ptr() % alignment):
                raise ValueError(f"MasterAdamW: a {what} {tuple(tensor.shape)} that is not contiguous or starts "
                                 f"at an address not a multiple of {alignment} bytes; accepted: contiguous "
                                 "tensors of their own allocation")
        if g is not None and (g.dtype != p.dtype or g.shape != p.shape):
            raise ValueError(f"MasterAdamW: a gradient of {g.dtype} {tuple(g.shape)} for a {p.dtype} "
                             f"{tuple(p.shape)} parameter; accepted: the parameter's dtype and shape")


class _FlatGroup:
    """One parameter group's flat fp32 buffers (master, exp_avg, exp_avg_sq), the views of them per tensor, and
    the tables the kernel reads: chunk -> (tensor, start), per tensor its numel, flat offset and addresses."""

    def __init__(self, params: list[torch.Tensor], device: torch.device):
        numels = [p.numel() for p in params]
        offsets = [0]
        for n in numels:
            offsets.append(offsets[-1] + -(-n // ALIGN) * ALIGN)
        self.master = torch.zeros(offsets[-1], dtype=torch.float32, device=device)
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.step = torch.zeros((), dtype=torch.float32, device=device)
        self.views = [{name: getattr(self, name)[start:start + n].view_as(p)
                       for name in ("master", "exp_avg", "exp_avg_sq")}
                      for p, start, n in zip(params, offsets, numels)]
        self.device, self._numels = device, numels
        self._chunks: dict[tuple[int, ...], dict[bool, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.numels = self._table(numels, torch.int32)
        self.flat_offsets = self._table(offsets[:-1], torch.int64)
        self.chunks_of(tuple(range(len(params))))  # step()'s tables, made here: not inside a CUDA graph's capture
        self.param_addrs = torch.zeros(len(params), dtype=torch.int64, device=device)
        self.grad_addrs = torch.zeros_like(self.param_addrs)
        self.known_addrs: dict[str, tuple[int, ...]] = {"param_addrs": (), "grad_addrs": ()}
        # What a CUDA graph's upload copies from at every replay: pinned host memory, written once, kept.
        self.capture_sources = {name: torch.empty(len(params), dtype=torch.int64, pin_memory=True)
                                for name in self.known_addrs} if device.type == "cuda" else {}
        self.captured: set[str] = set()

    def _table(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def chunks_of(self, tensors: tuple[int, ...]) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
        """The launch tables of these tensors (indices into the group), made at the first call (outside a CUDA
        graph's capture): (tensor, start) of each whole chunk (key True), and of each tensor's partial last chunk
        (key False)."""
        if tensors not in self._chunks:
            tables = {}
            for full in (True, False):
                chunks = [(t, start) for t in tensors for n in [self._numels[t]]
                          for start in (range(0, n - n % BLOCK, BLOCK) if full else [n - n % BLOCK] if n % BLOCK
                                        else [])]
                tables[full] = (self._table([t for t, _ in chunks], torch.int32),
                                self._table([start for _, start in chunks], torch.int32))
            self._chunks[tensors] = tables
        return self._chunks[tensors]

    def refresh(self, name: str, addrs: tuple[int, ...]) -> None:
        """Upload a table of addresses if they moved (the gradients' with a row more for each term past the first:
        ``Part.terms``). Inside a CUDA graph capture the upload comes from pinned memory written here (no host call
        may wait for the device then) and is replayed as is."""
        if addrs == self.known_addrs[name]:
            return
        table, source = getattr(self, name), torch.tensor(addrs, dtype=torch.int64)
        capturing = table.is_cuda and torch.cuda.is_current_stream_capturing()
        if table.numel() != len(addrs):  # gradients with terms, or no longer
            if capturing or name in self.captured:
                raise ValueError("MasterAdamW: a captured step's gradients must come as at its capture, with the same "
                                 "Part.terms or none: run an eager step with the same parts before capturing")
            table = torch.zeros(len(addrs), dtype=torch.int64, device=self.device)
            setattr(self, name, table)
            if name in self.capture_sources:
                self.capture_sources[name] = torch.empty(len(addrs), dtype=torch.int64, pin_memory=True)
        if capturing:
            if name in self.captured:
                raise ValueError("MasterAdamW: its step can be captured in one CUDA graph only (the graph reads "
                                 "the gradients' addresses from memory this optimizer keeps)")
            self.capture_sources[name].copy_(source)
            table.copy_(self.capture_sources[name], non_blocking=True)
            self.captured.add(name)
        else:
            table.copy_(source)
        # once captured, the graph's replays rewrite the table behind our back: eager steps then always upload
        self.known_addrs[name] = () if name in self.captured else addrs


class MasterAdamW(torch.optim.Optimizer):
    """AdamW over bf16 parameters with fp32 master weights and moments in flat buffers (see the module's doc).

    Construction takes the parameters as they are (fp32 weights keep their exact value as the master) and casts
    them to ``param_dtype`` in place, so build it before compiling or wrapping the model, and run the model
    without autocast. ``kernel``: True for the Triton kernel (CUDA, or CPU under ``TRITON_INTERPRET=1``), False
    for the same update in PyTorch ops, None to pick the kernel where it can run. ``state_dict`` holds, per
    parameter, ``master``, ``exp_avg``, ``exp_avg_sq`` (fp32) and ``step``; ``load_state_dict`` copies them
    into the flat buffers."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, param_dtype: torch.dtype = torch.bfloat16,
                 kernel: bool | None = None):
        if param_dtype not in PARAM_DTYPES:
            raise ValueError(f"MasterAdamW: param_dtype {param_dtype}; accepted: "
                             f"{', '.join(str(d) for d in PARAM_DTYPES)}")
        for name, value, ok in (("lr", lr, lr >= 0), ("eps", eps, eps >= 0), ("weight_decay", weight_decay,
                                weight_decay >= 0), ("betas", betas, all(0 <= b < 1 for b in betas))):
            if not ok or not all(math.isfinite(x) for x in (value if name == "betas" else (value,))):
                raise ValueError(f"MasterAdamW: {name}={value!r}; accepted: finite, >= 0 (betas in [0, 1))")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.param_dtype = param_dtype
        self.flat: list[_FlatGroup] = []
        for group in self.param_groups:
            params = group["params"]
            devices = {p.device for p in params}
            if len(devices) != 1:
                raise ValueError(f"MasterAdamW: a parameter group spans devices {sorted(map(str, devices))}")
            flat = _FlatGroup(params, devices.pop())
            for p, views in zip(params, flat.views):
                views["master"].copy_(p.detach())
                p.data = p.data.to(param_dtype)
                self.state[p] = {**views, "step": flat.step}
            self.flat.append(flat)
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        runnable = all(f.master.is_cuda or interpreted for f in self.flat)
        if kernel and not runnable:
            raise ValueError("MasterAdamW(kernel=True): the Triton kernel runs on CUDA, or on the CPU under "
                             "TRITON_INTERPRET=1")
        self.kernel = runnable if kernel is None else kernel

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "flat", None) is not None:  # after construction: the flat buffers are fixed
            raise ValueError("MasterAdamW: parameter groups are fixed at construction")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.step_parts([])
        return loss

    @torch.no_grad()
    def step_parts(self, parts: list[Part | tuple]) -> None:
        """``step()`` a part at a time, in order: for each ``Part`` (parameters, ready, terms), ``ready()`` (it makes
        the current stream wait for those parameters' gradients, e.g. a data-parallel wrapper's bucket), then one
        launch a parameter group updates them, from ``mean_of`` their terms where the part has them; parameters in
        no part go last. The first parts' update then runs while the last parts' gradients are still being
        communicated (``torch_impl.step``'s optimizer step "overlapped"), and the result is ``step()``'s after
        each ``.grad`` was set to ``mean_of`` its terms, bit for bit. Each parameter may be in one part at most."""
        where = {id(p): (k, j) for k, group in enumerate(self.param_groups) for j, p in enumerate(group["params"])}
        terms_of: dict[int, list[torch.Tensor]] = {}  # id(parameter) -> its terms
        plan: list[tuple[Callable[[], None] | None, dict[int, list[int]], int]] = []  # (ready, group -> tensors, terms)
        for params, ready, terms in (Part(*part) for part in parts):
            n_terms = len(terms[0]) if terms else 1
            if terms is not None and (len(terms) != len(params) or any(len(t) != n_terms for t in terms)):
                raise ValueError("MasterAdamW.step_parts: a part whose terms are not one list of equally many "
                                 "tensors for each of its parameters")
            members: dict[int, list[int]] = {}
            for p, term in zip(params, terms or [None] * len(params)):
                k, j = where.pop(id(p), (None, None))
                if k is None:
                    raise ValueError(f"MasterAdamW.step_parts: a parameter {tuple(p.shape)} that is in two parts "
                                     "or not this optimizer's; accepted: each of its parameters in one part at most")
                members.setdefault(k, []).append(j)
                if term is not None:
                    terms_of[id(p)] = term
            plan.append((ready, members, n_terms))
        rest: dict[int, list[int]] = {}
        for k, j in where.values():
            rest.setdefault(k, []).append(j)
        plan.append((None, rest, 1))
        for group, flat in zip(self.param_groups, self.flat):
            flat.step += 1
            params = group["params"]
            # each gradient's tensors: its terms, else itself (None: no gradient)
            grads = [None if p.grad is None else terms_of.get(id(p), [p.grad]) for p in params]
            rows = max(map(len, filter(None, grads)), default=1)
            addrs = tuple(p.data_ptr() for p in params), tuple(
                0 if g is None or j >= len(g) else g[j].data_ptr() for j in range(rows) for g in grads)
            if not self.kernel or addrs != (flat.known_addrs["param_addrs"], flat.known_addrs["grad_addrs"]):
                pairs = [(p, t) for p, g in zip(params, grads) for t in g or [None]]
                check_tensors([p for p, _ in pairs], [t for _, t in pairs], kernel=self.kernel)  # new tensors
            if self.kernel:
                flat.refresh("param_addrs", addrs[0])
                flat.refresh("grad_addrs", addrs[1])
        for ready, members, n_terms in plan:
            if ready is not None:
                ready()
            for k, tensors in members.items():
                if self.kernel:
                    self._kernel_step(self.param_groups[k], self.flat[k], tuple(sorted(tensors)), n_terms)
                else:
                    self._torch_step(self.param_groups[k], self.flat[k], tuple(sorted(tensors)), terms_of)

    def _kernel_step(self, group: dict, flat: _FlatGroup, tensors: tuple[int, ...], n_terms: int) -> None:
        beta1, beta2 = group["betas"]
        log2 = lambda beta: math.log2(beta) if beta > 0 else -math.inf  # noqa: E731
        for full, (chunk_tensor, chunk_start) in flat.chunks_of(tensors).items():  # whole chunks unmasked, then tails
            if chunk_tensor.numel():
                _adamw_master_kernel[(chunk_tensor.numel(),)](
                    chunk_tensor, chunk_start, flat.numels, flat.flat_offsets, flat.param_addrs, flat.grad_addrs,
                    flat.param_addrs.numel(), flat.master, flat.exp_avg, flat.exp_avg_sq, flat.step, group["lr"],
                    beta1, beta2, log2(beta1), log2(beta2), group["eps"], 1 - group["lr"] * group["weight_decay"],
                    PARAM_DTYPE=PARAM_DTYPES[self.param_dtype], BLOCK=BLOCK, ALIGN=ALIGN, FULL=full, TERMS=n_terms,
                    num_warps=8)

    def _torch_step(self, group: dict, flat: _FlatGroup, tensors: tuple[int, ...],
                    terms_of: dict[int, list[torch.Tensor]]) -> None:
        """The kernel's update in PyTorch ops, tensor by tensor (the CPU path without the interpreter)."""
        beta1, beta2 = group["betas"]
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        bias_correction1 = 1 - beta1 ** flat.step
        bias_correction2_sqrt = (1 - beta2 ** flat.step).sqrt()
        for j in tensors:
            p, views = group["params"][j], flat.views[j]
            if p.grad is None:
                continue
            g = (mean_of(terms_of[id(p)]) if id(p) in terms_of else p.grad).float()
            w, m, v = views["master"], views["exp_avg"], views["exp_avg_sq"]
            w.mul_(1 - lr * weight_decay)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            w.sub_(lr / bias_correction1 * m / (v.sqrt() / bias_correction2_sqrt + eps))
            p.copy_(w)

    def load_state_dict(self, state_dict: dict) -> None:
        """Copy a state dict of this optimizer's layout into the flat buffers (the base class would replace the
        state tensors, cast to the parameters' bf16). As torch's optimizers, it leaves the parameters alone: load
        the model's state dict too (its bf16 weights are its masters rounded)."""
        saved_groups = state_dict["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("MasterAdamW.load_state_dict: the saved parameter groups do not match this "
                             "optimizer's (number of groups or of parameters per group)")
        with torch.no_grad():
            for group, saved, flat in zip(self.param_groups, saved_groups, self.flat):
                group.update({k: v for k, v in saved.items() if k != "params"})
                for index, views in zip(saved["params"], flat.views):
                    state = state_dict["state"][index]
                    for name, view in views.items():
                        view.copy_(state[name])
                    flat.step.copy_(state["step"])


def adamw_for(dtype: str, params: Iterable, *, fused: bool, capturable: bool = False,
              **hyper) -> torch.optim.Optimizer:
    """The AdamW of a train step at ``--dtype`` (``analysis.harness.DTYPES``): ``MasterAdamW`` for
    ``bf16_mixed`` (it casts the weights to bf16: build it before a wrapper sees them, and run without
    autocast), else torch's AdamW (``fused``, ``capturable`` as asked) for fp32 weights. ``hyper``: lr,
    weight_decay, betas, eps."""
    if dtype == "bf16_mixed":
        return MasterAdamW(params, **hyper)
    return torch.optim.AdamW(params, fused=fused, capturable=capturable, **hyper)

"""Where does a training step's time go? A one-call probe for the step issue (GPU):
``python3 scripts/step_probe.py OUT``.

For each configuration (xl 4 x 512, xl 4 x 2,048, or ``--configs``) and variant (the stock reference or ours;
eager, compiled per block, or compiled whole), times ``--steps`` full train steps (bf16 autocast, fused AdamW)
after 3 warm-up steps (the first's time is the compile time), one synchronization per step, phases from CUDA
events; then the same variant with the device synchronized around every phase (the old harness); then a
``torch.profiler`` run of 2 steps: device-busy time per step against wall time (the gap is the CPU-bound idle
time), the device's idle time summed per pair of neighbouring kernels, the largest kernels and the host's self-CPU
time per op. Prints a table; writes everything to OUT/step_probe.json. Not a record: the e2e benchmark makes
those; this finds what to fix (notes/train_step.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from analysis.kernels import gpu_idle
from parallelism_calc.specs import get_model
from torch_impl.model import TransformerLM, cross_entropy
from torch_impl.optim import adamw_for
from torch_impl.parallelize import apply_compile
from torch_impl.profiling import is_kernel, kernel_intervals
from torch_impl.stock import StockTransformerLM
from torch_impl.timing import capture_step

# each may add +graph (the step as one CUDA graph), +ro (CUDA graph trees per block), +bf16 (pure bf16 parameters),
# +cpp (Inductor's C++ wrapper), +fuse (fused projections: fuse_projections), +mixed (bf16 parameters with
# MasterAdamW's fp32 masters: --dtype bf16_mixed), +ind:NAME=INT (an Inductor option for the blocks, e.g.
# +ind:triton.mix_order_reduction=0; several may be given), +skipguard (after the warm-up, Dynamo checks only the
# guards that tell its compiled graphs apart: torch.compiler.set_stance(skip_guard_eval_unsafe=True)), +apart (ours
# with q, k and v as three products, the model before torch_impl.qkv_projection: its route when a projection's call
# is hooked; with flash_triton also without its attention of the one product, which needs that product), +gsw (SwiGLU's W1 and W3 products with SiLU(h1) h3 in the epilogue of one persistent Gluon GEMM:
# torch_impl.swiglu_gluon.swiglu_product, sm_90; its backward cuBLAS's and Inductor's), +gsw2 (the model's
# mlp="gluon": the whole MLP as one op, +gsw's forward and SwiGLU's backward in the epilogue of dg = dy W2)
VARIANTS = ("stock_block", "ours_block", "stock_whole", "ours_whole", "ours_eager", "stock_eager",
            "ours_spanK")  # block: each block compiled; spanK: K consecutive blocks as one region (apply_compile)


def fuse_projections() -> None:
    """+fuse: one GEMM for q, k, v and one for w1, w3, on weights concatenated inside the graph (the
    parameters and their names stay): does a wider GEMM pay for the concatenation? (an experiment)"""
    import torch.nn.functional as F

    from torch_impl import model as ours

    def attention(self, x, positions=None):
        batch, seq, d_model = x.shape
        weight = torch.cat((self.q_proj.weight, self.k_proj.weight, self.v_proj.weight))
        q, k, v = (t.view(batch, seq, self.n_heads, -1) for t in F.linear(x, weight).split(d_model, dim=-1))
        q, k = self.rope(q, positions), self.rope(k, positions)
        out = self.attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
        return self.output_proj(out.transpose(1, 2).reshape(batch, seq, d_model))

    def swiglu(self, x):
        gate, up = F.linear(x, torch.cat((self.w1.weight, self.w3.weight))).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)

    ours.CausalSelfAttention.forward, ours.SwiGLU.forward = attention, swiglu


def product_forward(self, x: torch.Tensor) -> torch.Tensor:
    """+gsw: ``torch_impl.model.SwiGLU.forward`` with W1's and W3's products and SiLU(h1) h3 as one
    ``swiglu_product`` (the parameters stay the module's)."""
    from torch_impl.swiglu_gluon import swiglu_product

    _, _, g = swiglu_product(x.flatten(0, -2), self.w1.weight, self.w3.weight)
    return self.w2(g.unflatten(0, x.shape[:-1]))


def inductor_option(text: str) -> tuple[str, bool | int]:
    """NAME=INT as Inductor's config wants it: a bool where its default is a bool."""
    import torch._inductor.config as inductor_config

    name, value = text.split("=")
    return name, bool(int(value)) if isinstance(getattr(inductor_config, name), bool) else int(value)


def build(variant: str, spec, attention: str):
    if "+fuse" in variant:
        fuse_projections()
    if "+gsw" in variant and (variant.startswith("stock") or not ("+mixed" in variant or "+bf16" in variant)):
        raise ValueError(f"{variant}: +gsw takes ours with bf16 weights (+mixed or +bf16), which the kernels need")
    torch.manual_seed(0)
    model = TransformerLM(spec, attention=attention, device="cuda", mlp="gluon" if "+gsw2" in variant else "torch")
    if "+gsw" in variant and "+gsw2" not in variant:
        import types

        for block in model.layers:
            block.ffn.forward = types.MethodType(product_forward, block.ffn)
    if "+apart" in variant:  # a no-op hook on each projection: project_qkv calls the three modules one by one
        for block in model.layers:
            for projection in (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj):
                projection.register_forward_pre_hook(lambda module, args: None)
    if variant.startswith("stock"):
        stock = StockTransformerLM(spec, attention=attention, device="cuda")
        stock.load_state_dict(model.state_dict())
        model = stock
    if "+bf16" in variant:  # bf16 parameters and gradients, no autocast casts (+mixed: MasterAdamW casts them)
        model.to(torch.bfloat16)
    mode = variant.split("+")[0].split("_")[1]
    if mode == "block" and "+cpp" in variant:  # Inductor's C++ wrapper (apply_compile has no such option)
        for block in model.layers:
            block.compile(fullgraph=True, dynamic=False, options={"cpp_wrapper": True})
    elif mode == "block" or mode.startswith("span"):
        options = dict(inductor_option(part[len("ind:"):]) for part in variant.split("+") if part.startswith("ind:"))
        apply_compile(model, cuda_graphs="+ro" in variant, options=options,
                      blocks_per_graph=1 if mode == "block" else int(mode[len("span"):]))
    forward = torch.compile(model, dynamic=False) if mode == "whole" else model
    loss_fn = cross_entropy if mode == "eager" else torch.compile(cross_entropy, dynamic=False)
    return model, forward, loss_fn


def run_variant(variant: str, model_name: str, batch: int, seq: int, attention: str, steps: int) -> dict:
    spec = get_model(model_name)
    spec = spec.replace(context_length=max(seq, spec.context_length))
    t_start = time.perf_counter()
    model, forward, loss_fn = build(variant, spec, attention)
    graphed = "+graph" in variant
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled="+bf16" not in variant and "+mixed" not in variant)
    opt = adamw_for("bf16_mixed" if "+mixed" in variant else "bf16", model.parameters(), fused=True,
                    capturable=graphed, lr=1e-4)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (batch, seq + 1), generator=g).cuda()
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def eager_step(sync_phases: bool = False):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        events[0].record()
        with autocast:
            loss = loss_fn(forward(inputs), targets)
        if sync_phases:
            torch.cuda.synchronize()
        events[1].record()
        loss.backward()
        if sync_phases:
            torch.cuda.synchronize()
        events[2].record()
        opt.step()
        opt.zero_grad(set_to_none=True)
        events[3].record()
        return loss, events

    step = eager_step
    if graphed:  # the whole step (forward, backward, AdamW) as one CUDA graph, replayed
        def body() -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            with autocast:
                loss = loss_fn(forward(inputs), targets)
            loss.backward()
            opt.step()
            return loss.detach()

        replay = capture_step(body, warmup=3)

        def step(sync_phases: bool = False):
            events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            events[0].record()
            loss = replay()
            for e in events[1:]:
                e.record()
            return loss, events

    result = {"variant": variant, "model": model_name, "batch": batch, "seq": seq}
    loss, _ = step()
    first_loss = loss.item()
    result["first_step_s"] = time.perf_counter() - t_start  # build, compile, capture and one step
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    if "+skipguard" in variant:
        torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
    torch.cuda.reset_peak_memory_stats()
    for sync_phases in (False, True):
        walls, phases = [], []
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss, ev = step(sync_phases)
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) * 1e3)
            phases.append([ev[i].elapsed_time(ev[i + 1]) for i in range(3)])
        key = "synced" if sync_phases else "one_sync"
        result[f"{key}_step_ms"] = statistics.median(walls)
        result[f"{key}_step_min_ms"] = min(walls)
        result[f"{key}_phases_ms"] = [statistics.median(p[i] for p in phases) for i in range(3)]
    result["loss_first"], result["loss_last"] = first_loss, loss.item()
    result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    kernels = sorted(((e.key, e.self_device_time_total / 2e3, e.count // 2) for e in prof.key_averages()
                      if is_kernel(e)), key=lambda k: -k[1])
    result["device_busy_ms"] = sum(k[1] for k in kernels)
    idle = gpu_idle(kernel_intervals(prof), largest=12)  # where the device waits: gaps per pair of neighbours
    result["device_idle_ms"] = idle.idle_ms / 2
    result["idle_pairs"] = [(round(ms / 2, 3), count / 2, before[:60], after[:60])
                            for ms, count, before, after in idle.pairs]
    result["top_kernels"] = [(name[:90], round(ms, 3), n) for name, ms, n in kernels[:25]]
    host = sorted(((e.key, e.self_cpu_time_total / 2e3, e.count // 2) for e in prof.key_averages()
                   if e.self_cpu_time_total > 0), key=lambda k: -k[1])
    result["host_ms"] = sum(k[1] for k in host)
    torch.compiler.set_stance("default")  # explain below compiles anew
    result["top_host"] = [(name[:90], round(ms, 3), n) for name, ms, n in host[:25]]
    del model, forward, opt, step, eager_step
    gc.collect()
    torch.cuda.empty_cache()
    if variant.startswith("ours_block"):
        block = TransformerLM(spec.replace(n_layers=1), attention, device="cuda").layers[0]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            explained = torch._dynamo.explain(block)(torch.randn(batch, seq, spec.d_model, device="cuda"))
        result["explain_block"] = {"graphs": explained.graph_count, "breaks": explained.graph_break_count,
                                   "reasons": [str(b.reason)[:120] for b in explained.break_reasons]}
    torch._dynamo.reset()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--configs", default="xl:4:512,xl:4:2048")
    parser.add_argument("--variants", default="stock_block,ours_block,stock_whole")
    parser.add_argument("--attention", default="sdpa_cudnn")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for config in args.configs.split(","):
        model_name, batch, seq = config.split(":")
        for variant in args.variants.split(","):
            print(f"--- {config} {variant}", flush=True)
            try:
                r = run_variant(variant, model_name, int(batch), int(seq), args.attention, args.steps)
            except Exception as err:  # keep going: a failed variant is a row
                torch.compiler.set_stance("default")
                r = {"variant": variant, "config": config, "error": f"{type(err).__name__}: {err}"[:300]}
                gc.collect()
                torch.cuda.empty_cache()
            results.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "top_kernels"}), flush=True)
            (out / "step_probe.json").write_text(json.dumps(results, indent=1))
    print(f"\n{'config':<14}{'variant':<13}{'compile s':>10}{'step ms':>9}{'min':>8}{'synced':>8}"
          f"{'fwd/bwd/opt ms':>22}{'busy ms':>9}{'GiB':>6}  loss")
    for r in results:
        if "error" in r:
            print(f"{r['config']:<14}{r['variant']:<13} {r['error'][:100]}")
            continue
        ph = "/".join(f"{p:.1f}" for p in r["one_sync_phases_ms"])
        print(f"{r['model']}:{r['batch']}x{r['seq']:<8}{r['variant']:<13}{r['first_step_s']:>10.1f}"
              f"{r['one_sync_step_ms']:>9.1f}{r['one_sync_step_min_ms']:>8.1f}{r['synced_step_ms']:>8.1f}{ph:>22}"
              f"{r['device_busy_ms']:>9.1f}{r['peak_gib']:>6.1f}  {r['loss_first']:.3f}->{r['loss_last']:.3f}")
    for r in results:
        if "top_kernels" in r:
            print(f"\n{r['model']} {r['batch']}x{r['seq']} {r['variant']}: top kernels (ms/step, calls/step)")
            for name, ms, n in r["top_kernels"][:25]:
                print(f"  {ms:8.3f} {n:4d}  {name}")
            print(f"  device idle {r['device_idle_ms']:.2f} ms/step (gaps between steps too); largest by pair of "
                  "neighbours (ms/step, gaps/step):")
            for ms, count, before, after in r["idle_pairs"]:
                print(f"  {ms:8.3f} {count:6g}  {before} -> {after}")
            print(f"  host (self CPU ms/step, calls/step), total {r['host_ms']:.1f} ms:")
            for name, ms, n in r["top_host"][:25]:
                print(f"  {ms:8.3f} {n:4d}  {name}")
        if "explain_block" in r:
            print("  explain(block):", r["explain_block"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark one transformer layer (block) of the serial reference.

    python -m summasim.transformer.bench                       # b=8 s=256 h=1024 n=16 float32
    python -m summasim.transformer.bench --threads 1 2 --torch  # also PyTorch eager, same threads

Times ``block_forward`` and ``block_backward`` (best of ``--repeat``), and
measures with ``tracemalloc`` the peak memory of a ``--mem-layers``-layer model's
forward + backward with and without activation checkpointing.

``--torch`` times the same layer in PyTorch eager (imported lazily; torch is not
a summasim dependency: run this under a Python that has torch and summasim on
its path). NumPy and torch run in alternating blocks of steps in one process, so
the ratio is fair on a shared machine; the torch layer gets the same weights, and
its output and gradients are compared with ours.

Every argument is checked before anything is timed (sizes are positive
integers, the heads divide the hidden size, ``--torch`` needs torch importable,
the ``--json`` file can be written); a user error is one line on stderr and exit
status 2.
"""

from __future__ import annotations

import argparse
import gc
import math
import time
import tracemalloc

import numpy as np
from threadpoolctl import threadpool_limits

from summasim import cli
from summasim.jsonio import write_json_atomic

from . import model, ops

PROG = "python -m summasim.transformer.bench"


def _layer(hidden, heads, dtype, seed=0):
    """Layer-0 parameters of a 1-layer model under the block keys."""
    cfg = model.Config(vocab=8, seq=8, hidden=hidden, heads=heads, layers=1, dtype=dtype)
    return model.layer_params(model.init_params(cfg, seed), 0)


def _numpy_step(x, p, heads, dout):
    t0 = time.perf_counter()
    out, cache = ops.block_forward(x, p, heads)
    t1 = time.perf_counter()
    dx, grads = ops.block_backward(dout, cache)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, (out, dx, grads)


class _TorchLayer:
    """The same GPT-2 layer in PyTorch eager (weights held [out, in] like nn.Linear)."""

    def __init__(self, p, heads, sdpa=True):
        import torch
        import torch.nn.functional as F

        self.torch, self.F, self.heads, self.sdpa = torch, F, heads, sdpa
        self.params = {}
        for key, val in p.items():
            arr = val.T.copy() if key.endswith(".w") else val.copy()
            self.params[key] = torch.from_numpy(arr).requires_grad_(True)

    def forward(self, x):
        F, P, nh = self.F, self.params, self.heads
        b, t, c = x.shape
        a = F.layer_norm(x, (c,), P["ln1.g"], P["ln1.b"], eps=ops.LN_EPS)
        q, k, v = F.linear(a, P["attn.qkv.w"], P["attn.qkv.b"]).split(c, dim=2)
        q, k, v = (z.view(b, t, nh, c // nh).transpose(1, 2) for z in (q, k, v))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:   # nanoGPT's explicit path
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // nh))
            mask = self.torch.ones(t, t, dtype=self.torch.bool).tril()
            att = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        x = x + F.linear(y, P["attn.proj.w"], P["attn.proj.b"])
        m = F.layer_norm(x, (c,), P["ln2.g"], P["ln2.b"], eps=ops.LN_EPS)
        m = F.gelu(F.linear(m, P["mlp.fc.w"], P["mlp.fc.b"]), approximate="tanh")
        return x + F.linear(m, P["mlp.proj.w"], P["mlp.proj.b"])

    def step(self, x_np, dout_np):
        torch = self.torch
        x = torch.from_numpy(x_np).requires_grad_(True)
        dout = torch.from_numpy(dout_np)
        for prm in self.params.values():
            prm.grad = None
        t0 = time.perf_counter()
        out = self.forward(x)
        t1 = time.perf_counter()
        out.backward(dout)
        t2 = time.perf_counter()
        grads = {k: (v.grad.numpy().T if k.endswith(".w") else v.grad.numpy())
                 for k, v in self.params.items()}
        return t1 - t0, t2 - t1, (out.detach().numpy(), x.grad.numpy(), grads)


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), 1e-300))


def time_layer(batch, seq, hidden, heads, dtype, threads, repeat, use_torch, blocks=2):
    """Best forward/backward seconds of one layer over ``blocks`` blocks of ``repeat``
    timed steps per framework, NumPy and (optionally) torch."""
    rng = np.random.default_rng(0)
    p = _layer(hidden, heads, dtype)
    x = rng.standard_normal((batch, seq, hidden)).astype(dtype)
    dout = rng.standard_normal((batch, seq, hidden)).astype(dtype)
    res = {"threads": threads}
    runners = {"numpy": lambda: _numpy_step(x, p, heads, dout)}
    if use_torch:
        import torch

        torch.set_num_threads(threads)
        tl_sdpa, tl_manual = _TorchLayer(p, heads, sdpa=True), _TorchLayer(p, heads, sdpa=False)
        runners["torch"] = lambda: tl_sdpa.step(x, dout)
        runners["torch_manual_attn"] = lambda: tl_manual.step(x, dout)
    best = {name: [math.inf, math.inf] for name in runners}
    outputs = {}
    with threadpool_limits(threads):
        # Blocks of steps per framework, alternated (A B A B): switching frameworks
        # every step costs the next step its warm state (thread pools, freed pages),
        # so each block starts with an untimed warm-up step.
        for block in range(blocks):
            for name, run in runners.items():
                for rep in range(repeat + 1):
                    outputs.pop(name, None)
                    gc.collect()
                    tf, tb, outputs[name] = run()
                    if rep:
                        best[name][0] = min(best[name][0], tf)
                        best[name][1] = min(best[name][1], tb)
    for name, (tf, tb) in best.items():
        res[name] = {"forward_s": tf, "backward_s": tb, "total_s": tf + tb}
    if use_torch:
        ref_out, ref_dx, ref_g = outputs["torch"]
        out, dx, g = outputs["numpy"]
        res["max_rel_diff_vs_torch"] = max(
            [_rel(out, ref_out), _rel(dx, ref_dx)] + [_rel(g[k], ref_g[k]) for k in g])
        for name in ("torch", "torch_manual_attn"):
            res["ratio_vs_" + name] = res["numpy"]["total_s"] / res[name]["total_s"]
    return res


def peak_memory(batch, seq, hidden, heads, layers, dtype, vocab, checkpoint):
    """tracemalloc bytes of a model forward + backward, above params and inputs."""
    cfg = model.Config(vocab=vocab, seq=seq, hidden=hidden, heads=heads, layers=layers,
                       dtype=dtype)
    rng = np.random.default_rng(0)
    params = model.init_params(cfg, 0)
    tokens = rng.integers(0, vocab, (batch, seq))
    targets = rng.integers(0, vocab, (batch, seq))
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        _, cache = model.forward(params, tokens, targets, cfg, checkpoint=checkpoint)
        held = tracemalloc.get_traced_memory()[0] - base
        grads = model.backward(cache)
        del cache
        peak = tracemalloc.get_traced_memory()[1] - base
        grad_bytes = sum(g.nbytes for g in grads.values())
    finally:
        tracemalloc.stop()
    return {"checkpoint": checkpoint, "layers": layers, "held_after_forward_bytes": held,
            "peak_bytes": peak, "grad_bytes": grad_bytes}


def build_parser() -> argparse.ArgumentParser:
    """The command line; every argument is checked as it is parsed (:mod:`summasim.cli`),
    the rest by :func:`check_args`."""
    ap = cli.ArgumentParser(prog=PROG, description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=cli.positive_int, default=8, help="sequences b")
    ap.add_argument("--seq", type=cli.positive_int, default=256, help="sequence length s")
    ap.add_argument("--hidden", type=cli.positive_int, default=1024, help="hidden size h")
    ap.add_argument("--heads", type=cli.positive_int, default=16,
                    help="attention heads n (must divide --hidden)")
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--threads", type=cli.positive_int, nargs="+", default=[1],
                    help="BLAS / torch thread counts to time (default 1)")
    ap.add_argument("--repeat", type=cli.positive_int, default=3,
                    help="timed steps per block (after one warm-up step)")
    ap.add_argument("--blocks", type=cli.positive_int, default=2,
                    help="blocks per framework, alternated NumPy, torch, NumPy, torch, ...")
    ap.add_argument("--torch", action="store_true", help="also time PyTorch eager (needs torch)")
    ap.add_argument("--mem-layers", type=cli.nonnegative_int, default=4,
                    help="layers of the model whose peak memory is measured (0: skip)")
    ap.add_argument("--mem-vocab", type=cli.positive_int, default=512,
                    help="vocabulary of that model")
    ap.add_argument("--json", metavar="PATH", type=cli.writable_path,
                    help="also write the results as JSON (checked, and its folder made, first)")
    return ap


def check_args(args) -> None:
    """What no single argument tells; raises :class:`summasim.cli.UsageError`."""
    cli.require(args.hidden % args.heads == 0,
                f"argument --heads: {args.heads} heads do not divide --hidden {args.hidden} "
                f"(every head has hidden/heads whole columns)")
    cli.require(not args.torch or cli.module_available("torch"),
                "argument --torch: PyTorch is not installed in this Python (pip install "
                "torch, or run under a Python that has torch and summasim on its path)")


def main(argv=None):
    """Time one layer and measure peak memory; returns the results dict. A user
    error exits with status 2 after one line on stderr."""
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        check_args(args)
    except cli.UsageError as exc:
        ap.error(str(exc))
    dtype = np.dtype(args.dtype)
    print(f"one layer: b={args.batch} s={args.seq} h={args.hidden} n={args.heads} {dtype}, "
          f"best of {args.blocks} x {args.repeat} steps")
    results = {"shape": vars(args), "timing": [], "memory": []}
    for threads in args.threads:
        r = time_layer(args.batch, args.seq, args.hidden, args.heads, dtype, threads,
                       args.repeat, args.torch, args.blocks)
        results["timing"].append(r)
        for name in ("numpy", "torch", "torch_manual_attn"):
            if name in r:
                t = r[name]
                print(f"  threads={threads} {name:18s} forward {t['forward_s']*1e3:8.1f} ms  "
                      f"backward {t['backward_s']*1e3:8.1f} ms  total {t['total_s']*1e3:8.1f} ms")
        if args.torch:
            print(f"  threads={threads} numpy/torch {r['ratio_vs_torch']:.3f}  "
                  f"numpy/torch(manual attention) {r['ratio_vs_torch_manual_attn']:.3f}  "
                  f"max rel diff vs torch {r['max_rel_diff_vs_torch']:.2e}")
    if args.mem_layers:
        with threadpool_limits(max(args.threads)):
            for ckpt in (False, True):
                m = peak_memory(args.batch, args.seq, args.hidden, args.heads, args.mem_layers,
                                dtype, args.mem_vocab, ckpt)
                results["memory"].append(m)
                print(f"  memory {args.mem_layers}-layer model (vocab {args.mem_vocab}), "
                      f"checkpoint={str(ckpt):5s}: held after forward "
                      f"{m['held_after_forward_bytes']/2**20:7.1f} MiB, peak "
                      f"{m['peak_bytes']/2**20:7.1f} MiB (grads {m['grad_bytes']/2**20:.1f} MiB)")
        off, on = results["memory"]
        print(f"  checkpointing: peak x{on['peak_bytes']/off['peak_bytes']:.2f}, held after "
              f"forward x{on['held_after_forward_bytes']/off['held_after_forward_bytes']:.3f}")
    if args.json:
        write_json_atomic(args.json, results)
    return results


if __name__ == "__main__":
    main()

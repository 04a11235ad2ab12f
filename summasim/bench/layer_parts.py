"""Where the serial layer's step goes, part by part, in NumPy and in PyTorch (host).

``bench layer --torch`` times the whole layer in both libraries; this module times its
parts at the same shapes, on the same threads, each part's forward and backward together:

- ``linears``: the four linear layers with their biases (QKV, the attention's output
  projection, the MLP's two), ``x @ w + b`` and the input, weight and bias gradients;
- ``attention``: the causal attention of the heads, from the packed QKV activations to
  the merged heads (the scores, the softmax, ``att @ v`` and their gradients; torch's
  fused ``scaled_dot_product_attention``, and nanoGPT's explicit form);
- ``layer norms``: the two LayerNorms;
- ``GELU``: the MLP's activation.

Each library runs its own kernels: NumPy the ops of :mod:`summasim.transformer.ops` (on
NumPy's and SciPy's OpenBLAS), torch its eager ops under autograd (on its own BLAS, MKL
on x86 wheels). What the parts leave of a whole step is the rest: the residual adds, the
heads' layout copies and each framework's own work between ops (not timed apart: see
:func:`time_parts`). Compared over thread
counts, a part whose NumPy time does not fall with the threads while torch's does is
where threading is the gap (NumPy's elementwise ufuncs run on one thread; the BLAS is
threaded within one product, so a stack of small products gains little).
"""

from __future__ import annotations

import math

import numpy as np

from ..harness.timing import time_contenders

#: The parts, in the order they are printed.
PARTS = ("linears", "attention", "layer norms", "GELU")


#: Seconds of untimed calls that open each block of :func:`best_in_blocks`: longer than
#: a BLAS's idle threads keep spinning after its last call (OpenBLAS's default thread
#: timeout is 2^28 cycles, about 0.1 s at 2.5 GHz).
WARM_S = 0.25


def best_in_blocks(runs: dict, repeats: int, warm_s: float = WARM_S) -> dict:
    """The least seconds of each callable of ``runs`` (name -> fn) over ``repeats`` timed
    calls, run in two alternating blocks per name (one for ``repeats=1``), each opened
    by untimed calls for at least ``warm_s`` seconds (at least one call): a block is
    :func:`~summasim.harness.timing.time_contenders`, serial, one round.

    Right after one library's call its idle BLAS threads still spin for a while
    (OpenBLAS's and OpenMP's waits), and on shared cores a call of the other library
    made then runs on fewer: alternated call by call, torch's MKL read 120 GFLOP/s on
    2 threads against 206 on its own, and a block of torch's linears opened by one call
    right after NumPy's ran slower on 2 threads than on 1."""
    if repeats < 1:
        raise ValueError(f"best_in_blocks: repeats must be at least 1, got {repeats}")
    best = {name: math.inf for name in runs}
    for timed in (repeats - repeats // 2, repeats // 2):
        if timed:
            res = time_contenders(runs, None, 1, repeats=timed, warmup=1, warm_s=warm_s,
                                  rotate=False)
            best = {name: min(best[name], *res[name]["spans"]) for name in runs}
    return best


def _shapes(p: dict) -> list:
    """(name, in width, weight key, bias key) of the layer's four linears."""
    return [("qkv", p["attn.qkv.w"].shape[0], "attn.qkv.w", "attn.qkv.b"),
            ("proj", p["attn.proj.w"].shape[0], "attn.proj.w", "attn.proj.b"),
            ("fc", p["mlp.fc.w"].shape[0], "mlp.fc.w", "mlp.fc.b"),
            ("mlp.proj", p["mlp.proj.w"].shape[0], "mlp.proj.w", "mlp.proj.b")]


def _inputs(p: dict, batch: int, seq: int, heads: int, dtype) -> dict:
    """Random activations and output gradients of every part at the layer's shapes."""
    rng = np.random.default_rng(2)
    c = p["ln1.g"].shape[0]
    ffn = p["mlp.fc.w"].shape[1]

    def rand(*shape):
        return rng.standard_normal(shape).astype(dtype)

    lin = [(rand(batch, seq, width), p[wk], p[bk], rand(batch, seq, p[wk].shape[1]))
           for _, width, wk, bk in _shapes(p)]
    return {"lin": lin, "qkv": rand(batch, seq, 3 * c), "dy": rand(batch, seq, c),
            "x": rand(batch, seq, c), "dx": rand(batch, seq, c),
            "h": rand(batch, seq, ffn), "dh": rand(batch, seq, ffn),
            "g": p["ln1.g"], "b": p["ln1.b"], "heads": heads}


def numpy_parts(inp: dict) -> dict:
    """The parts as summasim's serial layer runs them: name -> one forward and backward,
    which returns its outputs and gradients (a list of tuples of arrays, the same list
    as :func:`torch_parts`'s)."""
    from ..transformer import ops

    heads = inp["heads"]
    qkv, dy = inp["qkv"], inp["dy"]
    b, t, c = dy.shape
    hd = c // heads

    def linears():
        out = []
        for x, w, bias, dout in inp["lin"]:
            y, cache = ops.linear_forward(x, w, bias)
            dx, grads = ops.linear_backward(dout, cache)
            out.append((y, dx, grads["w"], grads["b"]))
        return out

    def attention():
        q, k, v = ops.split_heads(qkv, heads)
        y = np.empty((b, t, c), dtype=qkv.dtype)
        _, cache = ops.attention_core_forward(
            q, k, v, out=y.reshape(b, t, heads, hd).transpose(0, 2, 1, 3))
        dqkv = np.empty_like(qkv)
        ops.attention_core_backward(dy.reshape(b, t, heads, hd).transpose(0, 2, 1, 3),
                                    cache, out=ops.split_heads(dqkv, heads))
        return [(y, dqkv)]

    def layer_norms():
        out = []
        for _ in range(2):
            y, cache = ops.layernorm_forward(inp["x"], inp["g"], inp["b"])
            dx, grads = ops.layernorm_backward(inp["dx"], cache)
            out.append((y, dx, grads["g"], grads["b"]))
        return out

    def gelu():
        y, cache = ops.gelu_forward(inp["h"])
        return [(y, ops.gelu_backward(inp["dh"], cache)[0])]

    return dict(zip(PARTS, (linears, attention, layer_norms, gelu)))


def torch_parts(inp: dict, sdpa: bool = True) -> dict:
    """The same parts in PyTorch eager, as :class:`summasim.bench.layer._TorchLayer` runs
    them (weights held [out, in] like ``nn.Linear``), each backward by
    ``torch.autograd.grad`` (no gradient accumulated into ``.grad``)."""
    import torch
    import torch.nn.functional as F

    from ..transformer.ops import LN_EPS

    heads = inp["heads"]

    def leaf(a, transpose=False):
        return torch.from_numpy(a.T.copy() if transpose else a).requires_grad_(True)

    lin = [(leaf(x), leaf(w, True), leaf(bias), torch.from_numpy(dout))
           for x, w, bias, dout in inp["lin"]]
    qkv, dy = leaf(inp["qkv"]), torch.from_numpy(inp["dy"])
    b, t, c = dy.shape
    x, dx, g, bn = leaf(inp["x"]), torch.from_numpy(inp["dx"]), leaf(inp["g"]), leaf(inp["b"])
    h, dh = leaf(inp["h"]), torch.from_numpy(inp["dh"])
    mask = torch.ones(t, t, dtype=torch.bool).tril()

    def linears():
        out = []
        for xi, w, bias, dout in lin:
            y = F.linear(xi, w, bias)
            dx, dw, db = torch.autograd.grad(y, (xi, w, bias), dout)
            out.append((y, dx, dw.T, db))
        return out

    def attention():
        q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2)
                   for z in qkv.split(c, dim=2))
        if sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // heads))
            y = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1) @ v
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return [(y, torch.autograd.grad(y, qkv, dy)[0])]

    def layer_norms():
        out = []
        for _ in range(2):
            y = F.layer_norm(x, (c,), g, bn, eps=LN_EPS)
            out.append((y,) + torch.autograd.grad(y, (x, g, bn), dx))
        return out

    def gelu():
        y = F.gelu(h, approximate="tanh")
        return [(y, torch.autograd.grad(y, h, dh)[0])]

    return dict(zip(PARTS, (linears, attention, layer_norms, gelu)))


def time_parts(p: dict, batch: int, seq: int, heads: int, dtype, repeats: int = 3,
               use_torch: bool = True) -> dict:
    """Least seconds of each part's forward and backward, on the threads in force:
    ``{"numpy": {part: s}, "torch": {...}, "torch_manual_attn": {"attention": s}}``
    (torch's only with ``use_torch``). Each part runs its libraries in alternating blocks
    (:func:`best_in_blocks`; one block each for ``repeats=1``), so a part's ratio is fair
    on a machine whose speed drifts.

    The parts are not subtracted from the whole step's time: on a machine whose speed
    drifts from minute to minute (this project's 2-core VM: the same NumPy step read
    1,319 and 1,850 ms in one launch), a difference of times taken minutes apart says
    more about the drift than about the residual adds and layout copies between the
    parts. Each part's ratio is taken in the same minute."""
    inp = _inputs(p, batch, seq, heads, dtype)
    libs = {"numpy": numpy_parts(inp)}
    if use_torch:
        libs["torch"] = torch_parts(inp)
        libs["torch_manual_attn"] = {"attention": torch_parts(inp, sdpa=False)["attention"]}
    out: dict = {lib: {} for lib in libs}
    for part in PARTS:
        best = best_in_blocks({lib: fns[part] for lib, fns in libs.items() if part in fns},
                              repeats)
        for lib, s in best.items():
            out[lib][part] = s
    return out


def adam_peers(shapes: dict, dtype, repeats: int = 3) -> dict:
    """Least seconds of one Adam step over parameters of ``shapes`` (key -> shape):
    ``{"numpy": s, "torch": s}``, each as its data-parallel step runs it: summasim's
    :class:`summasim.transformer.train.Adam` on one flat vector of all the parameters
    (the trainer's ZeRO-0 update), ``torch.optim.Adam`` on each parameter
    (``foreach=False``, as ``bench mesh``'s DDP peer), in alternating blocks
    (:func:`best_in_blocks`; one block each for ``repeats=1``). Every data-parallel
    rank runs it on the whole model once per step."""
    import torch

    from ..transformer.train import Adam

    rng = np.random.default_rng(3)
    n = sum(math.prod(shape) for shape in shapes.values())
    flat = {"flat": rng.standard_normal(n).astype(dtype)}
    grad = {"flat": (1e-3 * rng.standard_normal(n)).astype(dtype)}
    ours = Adam(lr=1e-3)
    leaves, at = [], 0
    for shape in shapes.values():
        size = math.prod(shape)
        leaf = torch.from_numpy(flat["flat"][at:at + size].reshape(shape).copy())
        leaf.requires_grad_(True)
        leaf.grad = torch.from_numpy(grad["flat"][at:at + size].reshape(shape).copy())
        leaves.append(leaf)
        at += size
    theirs = torch.optim.Adam(leaves, lr=1e-3, foreach=False)
    return best_in_blocks({"numpy": lambda: ours.step(flat, grad),
                           "torch": theirs.step}, repeats)


def describe(parts: dict, ours: str = "numpy") -> list[str]:
    """Lines: each part's ms in NumPy and torch and their ratio (the attention's also
    against torch's attention written out), then the parts together."""
    lines = []
    for part in PARTS:
        a, b = parts[ours][part], parts["torch"][part]
        extra = ""
        if part == "attention" and "torch_manual_attn" in parts:
            m = parts["torch_manual_attn"]["attention"]
            extra = f" (torch written out {m * 1e3:.1f} ms, {a / m:.2f}x)"
        lines.append(f"{part:12s} {ours} {a * 1e3:8.1f} ms  torch {b * 1e3:8.1f} ms  "
                     f"{ours}/torch {a / b:.2f}x{extra}")
    a, b = (sum(parts[lib][k] for k in PARTS) for lib in (ours, "torch"))
    lines.append(f"{'together':12s} {ours} {a * 1e3:8.1f} ms  torch {b * 1e3:8.1f} ms  "
                 f"{ours}/torch {a / b:.2f}x")
    return lines


def speedups(timing: list, ours: str = "numpy") -> list[str]:
    """Lines: each part's speed-up from the first thread count to each later one, per
    library (``timing``: :func:`summasim.bench.layer.time_layer` results with
    ``parts``), which says where threading is the gap."""
    if not timing:
        return []
    first = timing[0]
    lines = []
    for r in timing[1:]:
        cells = []
        for part in PARTS:
            libs = [lib for lib in (ours, "torch") if lib in r["parts"]]
            cells.append(f"{part} " + " ".join(
                f"{lib} {first['parts'][lib][part] / r['parts'][lib][part]:.2f}x"
                for lib in libs))
        lines.append(f"speed-up from {first['threads']} to {r['threads']} threads: "
                     + "; ".join(cells))
    return lines

"""``bench layer``: one transformer layer (block) of the serial reference, next to
PyTorch eager (serial: no MPI).

    python -m summasim.bench layer                          # b=8 s=256 h=1024 n=16 float32
    python -m summasim.bench layer --threads 1 2 --torch    # also PyTorch eager, same threads
    python -m summasim.bench layer --backend cupy --torch --dtype bfloat16   # on the GPU

Times ``block_forward`` and ``block_backward`` (best of ``--repeats`` steps in each of
``--blocks`` blocks), and measures with ``tracemalloc`` the peak memory of the whole
``--model`` (its layers and vocabulary) forward + backward with and without activation
checkpointing (``--no-memory``: skip).

``--torch`` times the same layer in PyTorch eager (imported lazily; torch is not a
summasim dependency: run this under a Python that has torch and summasim on its path).
summasim and torch run in alternating blocks of steps in one process, so the ratio is
fair on a shared machine; the torch layer gets the same weights, and its output and
gradients are compared with ours. On the host it then says where the step goes: the
layer's widest GEMM in both libraries' BLAS, and each part of the layer (the linears, the
attention, the LayerNorms, the GELU) timed in both libraries, with each part's speed-up
over the thread counts (:mod:`summasim.bench.layer_parts`).

``--backend cupy`` runs our layer on CuPy arrays and torch's on the same GPU (``cuda``);
each timed step ends with a wait for the device, and the memory measurement (host
``tracemalloc``) is skipped. ``--dtype bfloat16`` (or float16) is mixed precision: our
layer under :func:`summasim.transformer.ops.autocast` (16-bit values handed between ops,
float32 arithmetic) on weights and inputs rounded to 16 bits, torch's under
``torch.autocast`` with the same rounded weights.

Every argument is checked before anything is timed (``--torch`` needs torch importable,
the ``--json`` file can be written); a user error is one line on stderr and exit status 2.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
import tracemalloc

import numpy as np

from .. import cli
from .common import add_json, given
from . import layer_parts
from .layer_parts import best_in_blocks

#: the default model: the timed layer is h=1024 n=16 at s=256 (b=8); the memory model
#: has 4 such layers and a vocabulary of 512
DEFAULT_MODEL = "h=1024,heads=16,layers=4,seq=256,vocab=512"
DEFAULT_BATCH = 8
DEFAULT_REPEATS = 3


#: Bounds of the layer benchmark's counts: each is work done in full, serially.
MAX_THREADS, MAX_REPEATS, MAX_BLOCKS = 256, 1000, 100


def add_arguments(ap):
    from ..options import add_batch, add_dtype, add_model

    add_model(ap, default=DEFAULT_MODEL,
              help_more="; the layer is timed at its h, heads and seq, the memory "
                        "measured on the whole model")
    add_batch(ap, help_more=f"; {DEFAULT_BATCH} for a model without one")
    add_dtype(ap, choices=("float32", "float64", "bfloat16", "float16"), default="float32",
              help_more="; bfloat16 and float16: mixed precision (16-bit values between "
                        "ops, float32 arithmetic and weights)")
    ap.add_argument("--backend", choices=("numpy", "cupy"), default="numpy",
                    help="our layer's arrays: numpy (CPU) or cupy (GPU; torch then runs on "
                         "the same GPU) (default numpy)")
    ap.add_argument("--threads", type=cli.int_between(1, MAX_THREADS), nargs="+", default=[1],
                    help=f"BLAS / torch thread counts to time, 1 to {MAX_THREADS} each "
                         f"(default 1)")
    ap.add_argument("--repeats", type=cli.int_between(1, MAX_REPEATS), default=DEFAULT_REPEATS,
                    help=f"timed steps per block, after one warm-up step, 1 to {MAX_REPEATS} "
                         f"(default {DEFAULT_REPEATS})")
    ap.add_argument("--blocks", type=cli.int_between(1, MAX_BLOCKS), default=2,
                    help=f"blocks per framework, alternated NumPy, torch, NumPy, torch, ..., "
                         f"1 to {MAX_BLOCKS} (default 2)")
    ap.add_argument("--torch", action="store_true", help="also time PyTorch eager (needs torch)")
    ap.add_argument("--no-memory", action="store_true",
                    help="skip the peak-memory measurement of the whole model")
    add_json(ap)


def check(args) -> None:
    """What the parser cannot tell; raises :class:`summasim.cli.UsageError`."""
    from ..backends import unavailable
    from ..harness.memory import available_bytes

    cli.require(not args.torch or cli.module_available("torch"),
                "argument --torch: PyTorch is not installed in this Python (pip install "
                "torch, or run under a Python that has torch and summasim on its path)")
    why = unavailable(args.backend)
    cli.require(not why, f"argument --backend: {why}")
    if args.torch and args.backend == "cupy":
        import torch

        cli.require(torch.cuda.is_available(),
                    "argument --torch with --backend cupy: this torch sees no GPU")
    model = args.model
    cli.require(model.mlp == "gelu" and model.kv_heads == model.heads,
                f"argument --model: bench layer times GPT-2's layer (GELU MLP, one key/value "
                f"head per head) next to torch's; {model} is mlp={model.mlp}, kv_heads="
                f"{model.kv_heads}")
    if args.backend == "numpy":
        batch = given(args, "batch", None) or model.batch or DEFAULT_BATCH
        need = layer_bench_bytes(model, batch, args.dtype, args.torch, not args.no_memory)
        have = available_bytes()
        if need > have:
            lo, hi = 0, batch            # the bytes grow with the batch: bisect
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if layer_bench_bytes(model, mid, args.dtype, args.torch,
                                     not args.no_memory) <= have:
                    lo = mid
                else:
                    hi = mid
            raise cli.UsageError(
                f"argument --batch: one layer of {model} at batch {batch} needs about "
                f"{need / GIB:.1f} GiB here, {have / GIB:.1f} GiB are available; "
                + (f"the largest batch that fits is {lo}" if lo else
                   "no batch fits this model" + ("" if args.no_memory else
                                                 " (--no-memory skips the whole model)")))
    if args.json:
        try:
            cli.check_writable_path(args.json)
        except cli.UsageError as e:
            raise cli.argument_error("--json", e) from None


GIB = float(1 << 30)


def layer_bench_bytes(model, batch: int, dtype: str, use_torch: bool, memory: bool) -> int:
    """An upper estimate of the host bytes ``bench layer`` holds at once: one layer's
    weights and gradients, (4 + 2f) h^2 values each; its input and output gradient; its
    cache and the backward's temporaries, about (10 + 4f) b s h + 3 n b s^2 values
    (Korthikanti et al. 2022's 34 s b h + 5 n s^2 b bytes of 16-bit activations, in
    values, with room for the backward); twice that beside torch. With ``memory``, also
    the whole model's forward and backward in that dtype (its weights and gradients,
    every layer's cache and the logits). 16-bit dtypes are held in float32."""
    it = 8 if str(dtype) == "float64" else 4
    b, s, h, n, f = batch, model.seq, model.hidden, model.heads, model.ffn_mult
    weights = (4 + 2 * f) * h * h + (9 + 2 * f) * h
    act = (10 + 4 * f) * b * s * h + 3 * n * b * s * s
    one = it * (2 * weights + 2 * act + 2 * b * s * h) * (2 if use_torch else 1)
    whole = 0
    if memory:
        params = model.layers * weights + (model.vocab + s) * h
        whole = it * (2 * params + model.layers * act + 3 * b * s * model.vocab)
    return int(max(one, whole))


def _layer(model, dtype, seed=0):
    """Layer-0 parameters of a 1-layer model of ``model``'s width under the block keys."""
    from ..transformer import model as serial

    cfg = serial.Config(vocab=8, seq=8, hidden=model.hidden, heads=model.heads, layers=1,
                        ffn_mult=model.ffn_mult, dtype=dtype)
    return serial.layer_params(serial.init_params(cfg, seed), 0)


def _our_step(x, p, heads, dout, precision, sync):
    """One forward and backward of our layer: ``(forward s, backward s, outputs)``;
    ``sync()`` waits for the device before each clock reading."""
    from ..transformer import ops

    with ops.autocast(precision):
        sync()
        t0 = time.perf_counter()
        out, cache = ops.block_forward(x, p, heads)
        sync()
        t1 = time.perf_counter()
        dx, grads = ops.block_backward(dout, cache)
        sync()
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1, (out, dx, grads)


class _TorchLayer:
    """The same GPT-2 layer in PyTorch eager (weights held [out, in] like nn.Linear)."""

    def __init__(self, p, heads, sdpa=True, device="cpu", autocast=None):
        import torch
        import torch.nn.functional as F

        self.torch, self.F, self.heads, self.sdpa = torch, F, heads, sdpa
        self.device, self.autocast = device, autocast
        self.params = {}
        for key, val in p.items():
            arr = val.T.copy() if key.endswith(".w") else val.copy()
            self.params[key] = torch.from_numpy(arr).to(device).requires_grad_(True)

    def forward(self, x):
        from ..transformer.ops import LN_EPS

        F, P, nh = self.F, self.params, self.heads
        b, t, c = x.shape
        a = F.layer_norm(x, (c,), P["ln1.g"], P["ln1.b"], eps=LN_EPS)
        q, k, v = F.linear(a, P["attn.qkv.w"], P["attn.qkv.b"]).split(c, dim=2)
        q, k, v = (z.view(b, t, nh, c // nh).transpose(1, 2) for z in (q, k, v))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:   # nanoGPT's explicit path
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // nh))
            mask = self.torch.ones(t, t, dtype=self.torch.bool, device=x.device).tril()
            att = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        x = x + F.linear(y, P["attn.proj.w"], P["attn.proj.b"])
        m = F.layer_norm(x, (c,), P["ln2.g"], P["ln2.b"], eps=LN_EPS)
        m = F.gelu(F.linear(m, P["mlp.fc.w"], P["mlp.fc.b"]), approximate="tanh")
        return x + F.linear(m, P["mlp.proj.w"], P["mlp.proj.b"])

    def step(self, x_np, dout_np):
        torch = self.torch
        x = torch.from_numpy(x_np).to(self.device).requires_grad_(True)
        dout = torch.from_numpy(dout_np).to(self.device)
        for prm in self.params.values():
            prm.grad = None
        sync = torch.cuda.synchronize if self.device == "cuda" else _nothing
        cast = (torch.autocast(self.device, dtype=getattr(torch, self.autocast))
                if self.autocast else contextlib.nullcontext())
        sync()
        t0 = time.perf_counter()
        with cast:
            out = self.forward(x)
        sync()
        t1 = time.perf_counter()
        out.backward(dout.to(out.dtype))
        sync()
        t2 = time.perf_counter()

        def host(t):
            return t.detach().float().cpu().numpy()

        grads = {k: (host(v.grad).T if k.endswith(".w") else host(v.grad))
                 for k, v in self.params.items()}
        return t1 - t0, t2 - t1, (host(out), host(x.grad), grads)


def gemm_peers(m: int, k: int, n: int, dtype, repeats: int = 5,
                linear: bool = False) -> dict:
    """The layer's widest GEMM (``[m, k] @ [k, n]``, the MLP's first) in NumPy and in
    PyTorch on the host, on the threads in force: best GFLOP/s of ``repeats`` (in two
    alternating blocks per library, one for ``repeats=1``), and each library's BLAS.
    The two layers' GEMMs run on these libraries, so their ratio is the part of the
    layers' ratio that is the BLAS's, not summasim's (NumPy and SciPy bring OpenBLAS;
    PyTorch's x86 wheels bring MKL). ``linear``: the
    three products of that linear layer's step instead, ``x @ w``, ``dy @ w.T`` and
    ``x.T @ dy``, timed together (``passes`` 3)."""
    import torch
    from threadpoolctl import threadpool_info

    rng = np.random.default_rng(1)
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    if linear:
        dy = rng.standard_normal((m, n)).astype(dtype)
        tdy = torch.from_numpy(dy)
        runs = {"numpy": lambda: (a @ b, dy @ b.T, a.T @ dy),
                "torch": lambda: (torch.mm(ta, tb), torch.mm(tdy, tb.T), torch.mm(ta.T, tdy))}
    else:
        runs = {"numpy": lambda: np.matmul(a, b), "torch": lambda: torch.mm(ta, tb)}
    best = best_in_blocks(runs, repeats)
    libs = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    # NumPy's own BLAS (SciPy may load another copy, of another version, first)
    libs.sort(key=lambda i: "numpy" not in str(i.get("filepath", "")))
    blas = next((f"{i['internal_api']} {i.get('version') or ''}".strip() for i in libs),
                "unknown")
    torch_blas = next((w.split("=", 1)[1] for w in torch.__config__.show().replace(",", " ")
                       .split() if w.startswith("BLAS_INFO=")), "unknown")
    flops = 2.0 * m * k * n * (3 if linear else 1)
    return {"shape": [m, k, n], "passes": 3 if linear else 1,
            "numpy_gflops": flops / best["numpy"] / 1e9,
            "torch_gflops": flops / best["torch"] / 1e9, "numpy_blas": blas,
            "torch_blas": torch_blas}


def _nothing() -> None:
    """A host-only step's wait for the device."""


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), 1e-300))


def time_layer(model, batch, dtype, threads, repeats, use_torch, blocks=2, backend="numpy"):
    """Best forward/backward seconds of one layer of ``model`` (its h, heads and seq) over
    ``blocks`` blocks of ``repeats`` timed steps per framework, ours and (optionally)
    torch (:func:`~summasim.harness.timing.time_contenders`, serial, in blocks).
    ``dtype`` bfloat16/float16: mixed precision (weights and inputs rounded to it, float32
    arithmetic); ``backend`` "cupy": on the GPU, torch too."""
    from threadpoolctl import threadpool_limits

    from ..backends import get_backend
    from ..harness.timing import time_contenders
    from ..transformer.precision import Precision

    dtype = np.dtype(dtype) if str(dtype) not in ("bfloat16", "float16") else str(dtype)
    precision = Precision.of(dtype) if isinstance(dtype, str) else None
    store = np.float32 if precision is not None else dtype
    rng = np.random.default_rng(0)
    p = _layer(model, store)
    heads = model.heads
    x = rng.standard_normal((batch, model.seq, model.hidden)).astype(store)
    dout = rng.standard_normal((batch, model.seq, model.hidden)).astype(store)
    if precision is not None:            # 16-bit weights and inputs, as a trainer holds them
        p, x, dout = precision.round_tree(p), precision.round(x), precision.round(dout)
    be = get_backend(backend)
    dev_p = {k: be.asarray(v) for k, v in p.items()}
    dev_x, dev_dout = be.asarray(x), be.asarray(dout)
    sync = be.synchronize if be.on_device else _nothing
    res = {"threads": threads, "backend": backend}
    runners = {backend: lambda: _our_step(dev_x, dev_p, heads, dev_dout, precision, sync)}
    if use_torch:
        import torch

        torch.set_num_threads(threads)
        device = "cuda" if be.on_device else "cpu"
        cast = dtype if precision is not None else None
        tl_sdpa = _TorchLayer(p, heads, sdpa=True, device=device, autocast=cast)
        tl_manual = _TorchLayer(p, heads, sdpa=False, device=device, autocast=cast)
        runners["torch"] = lambda: tl_sdpa.step(x, dout)
        runners["torch_manual_attn"] = lambda: tl_manual.step(x, dout)
    outputs = {}

    def keep(name, run):
        """A step that keeps its outputs (the last step's, for the comparison) and
        returns its forward and backward seconds."""
        def call():
            tf, tb, outputs[name] = run()
            return tf, tb
        return call

    def fresh(name):
        """Before each step: drop the framework's last outputs, collect the garbage."""
        outputs.pop(name, None)
        gc.collect()

    with threadpool_limits(threads):
        # Blocks of steps per framework, alternated (A B A B): switching frameworks
        # every step costs the next step its warm state (thread pools, freed pages),
        # so each block starts with an untimed warm-up step.
        timed = time_contenders({k: keep(k, f) for k, f in runners.items()}, None, blocks,
                                repeats=repeats, warmup=1, rotate=False, before=fresh,
                                returns=True)
        if use_torch and not be.on_device:
            res["gemm"] = gemm_peers(batch * model.seq, model.hidden, model.ffn_width,
                                      store if precision is None else np.float32)
            if precision is None:
                res["parts"] = layer_parts.time_parts(p, batch, model.seq, heads, store,
                                                      repeats=repeats)
    for name, t in timed.items():
        tf = min(r[0] for r in t["returns"])
        tb = min(r[1] for r in t["returns"])
        res[name] = {"forward_s": tf, "backward_s": tb, "total_s": tf + tb}
    if use_torch:
        ref_out, ref_dx, ref_g = outputs["torch"]
        ours = outputs[backend]
        out, dx, g = (be.to_numpy(ours[0]), be.to_numpy(ours[1]),
                      {k: be.to_numpy(v) for k, v in ours[2].items()})
        res["max_rel_diff_vs_torch"] = max(
            [_rel(out, ref_out), _rel(dx, ref_dx)] + [_rel(g[k], ref_g[k]) for k in g])
        for name in ("torch", "torch_manual_attn"):
            res["ratio_vs_" + name] = res[backend]["total_s"] / res[name]["total_s"]
    return res


def peak_memory(model, batch, dtype, checkpoint):
    """tracemalloc bytes of ``model``'s forward + backward, above params and inputs."""
    from ..transformer import model as serial

    cfg = serial.Config.of(model, dtype)
    rng = np.random.default_rng(0)
    params = serial.init_params(cfg, 0)
    tokens = rng.integers(0, model.vocab, (batch, model.seq))
    targets = rng.integers(0, model.vocab, (batch, model.seq))
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        _, cache = serial.forward(params, tokens, targets, cfg, checkpoint=checkpoint)
        held = tracemalloc.get_traced_memory()[0] - base
        grads = serial.backward(cache)
        del cache
        peak = tracemalloc.get_traced_memory()[1] - base
        grad_bytes = sum(g.nbytes for g in grads.values())
    finally:
        tracemalloc.stop()
    return {"checkpoint": checkpoint, "layers": model.layers, "held_after_forward_bytes": held,
            "peak_bytes": peak, "grad_bytes": grad_bytes}


def run(args, world=None) -> dict:
    """Time one layer and measure peak memory (serial: ``world`` is not used); returns
    the results dict."""
    from threadpoolctl import threadpool_limits

    from ..jsonio import write_report

    model = args.model
    batch = given(args, "batch", None) or model.batch or DEFAULT_BATCH
    mixed = args.dtype in ("bfloat16", "float16")
    dtype = args.dtype if mixed else np.dtype(args.dtype)
    ours = args.backend
    print(f"one layer: b={batch} s={model.seq} h={model.hidden} n={model.heads} "
          f"{args.dtype}{' (mixed)' if mixed else ''} on {ours}, best of {args.blocks} x "
          f"{args.repeats} steps")
    shape = {"model": str(model), "batch": batch, "dtype": args.dtype, "backend": ours,
             "threads": args.threads, "repeats": args.repeats, "blocks": args.blocks,
             "torch": args.torch}
    from ..harness.load import LoadWatch, combine, describe, warning

    results = {"shape": shape, "timing": [], "memory": []}
    watch = LoadWatch(None)
    for threads in args.threads:
        watch.lap()
        r = time_layer(model, batch, dtype, threads, args.repeats, args.torch, args.blocks,
                       backend=ours)
        r["load"] = watch.lap()
        r["quiet"] = r["load"]["quiet"]
        results["timing"].append(r)
        print(f"  threads={threads} load: {describe(r['load'])}")
        for name in (ours, "torch", "torch_manual_attn"):
            if name in r:
                t = r[name]
                print(f"  threads={threads} {name:18s} forward {t['forward_s']*1e3:8.2f} ms  "
                      f"backward {t['backward_s']*1e3:8.2f} ms  total {t['total_s']*1e3:8.2f} "
                      f"ms")
        if args.torch:
            print(f"  threads={threads} {ours}/torch {r['ratio_vs_torch']:.3f}  "
                  f"{ours}/torch(manual attention) {r['ratio_vs_torch_manual_attn']:.3f}  "
                  f"max rel diff vs torch {r['max_rel_diff_vs_torch']:.2e}")
        if "gemm" in r:
            g = r["gemm"]
            print(f"  threads={threads} the MLP's GEMM {g['shape'][0]}x{g['shape'][1]}x"
                  f"{g['shape'][2]}: NumPy ({g['numpy_blas']}) {g['numpy_gflops']:.1f} "
                  f"GFLOP/s, torch ({g['torch_blas']}) {g['torch_gflops']:.1f}: "
                  f"numpy/torch {g['torch_gflops'] / g['numpy_gflops']:.3f} from the BLAS "
                  f"alone")
        if "parts" in r:
            print(f"  threads={threads} where the step goes (each part's forward and "
                  f"backward, best of {args.repeats}):")
            for line in layer_parts.describe(r["parts"], ours):
                print(f"    {line}")
        elif args.torch:
            print(f"  threads={threads} where the step goes: not timed part by part "
                  f"({'on the GPU' if ours != 'numpy' else 'under mixed precision'}; "
                  f"the parts are the host's float32/float64 ops)")
    for line in layer_parts.speedups([r for r in results["timing"] if "parts" in r], ours):
        print(f"  {line}")
    results["load"] = combine(r["load"] for r in results["timing"])
    line = warning(results["load"], "the layer was timed")
    if line:
        print(line)
    if ours != "numpy" or mixed:
        args.no_memory = True
        print("  memory: not measured (the measurement is the host's tracemalloc of the "
              "float32/float64 model)")
    if not args.no_memory:
        with threadpool_limits(max(args.threads)):
            for ckpt in (False, True):
                m = peak_memory(model, batch, dtype, ckpt)
                results["memory"].append(m)
                print(f"  memory {model.layers}-layer model (vocab {model.vocab}), "
                      f"checkpoint={str(ckpt):5s}: held after forward "
                      f"{m['held_after_forward_bytes']/2**20:7.1f} MiB, peak "
                      f"{m['peak_bytes']/2**20:7.1f} MiB (grads {m['grad_bytes']/2**20:.1f} MiB)")
        off, on = results["memory"]
        print(f"  checkpointing: peak x{on['peak_bytes']/off['peak_bytes']:.2f}, held after "
              f"forward x{on['held_after_forward_bytes']/off['held_after_forward_bytes']:.3f}")
    if args.json:
        write_report(args.json, "bench", results)
    return results

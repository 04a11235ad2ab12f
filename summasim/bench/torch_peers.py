"""PyTorch peers of ``bench mesh --torch``: the same model, batch, micro-batches and Adam,
trained by what a user would run instead of summasim, in the same launch.

- **DDP** (``torch.nn.parallel.DistributedDataParallel`` over gloo) next to summasim's
  pure data parallelism (``--mesh dp=P``, ZeRO 0): each rank trains its ``B / P`` rows in
  the mesh's micro-batches (``no_sync`` on all but the last), DDP averages the
  gradients in its buckets (25 MiB, as summasim's ``--bucket`` default) while the
  backward runs.
- **DTensor** (``torch.distributed.tensor.parallel``) next to summasim's pure Megatron
  tensor parallelism (``tp=megatron:P``): q, k, v and the MLP's first linear
  ``ColwiseParallel``, the two output projections ``RowwiseParallel`` (Megatron's
  split, one all-reduce per block in the forward and one in the backward); the
  embeddings, layer norms and the head are replicated, every rank the whole batch.

Both start from summasim's serial parameters (:func:`summasim.transformer.model.init_params`,
the model's own dtype) and tokens, and are checked before they are timed: the first
loss and the first step's gradients equal the serial model's within the mesh's own
bound, and after the timed steps every replicated parameter is bit-identical over the
ranks. The model is the GPT
of :mod:`summasim.transformer.model` written with ``torch.nn``: GELU (tanh) MLP,
multi-head attention (``scaled_dot_product_attention``, causal), tied or untied head,
mean cross-entropy. Other variants have no peer here (:func:`peer_reason`).

torch is not a summasim dependency: it is imported only here, only when asked for.
"""

from __future__ import annotations

import contextlib
import math
import socket

import numpy as np

#: The gloo store's wait for every rank to connect (s).
STORE_TIMEOUT_S = 120


def peer_reason(case) -> str:
    """Why ``case`` (a :class:`~summasim.harness.cases.MeshCase`) has no PyTorch peer
    here ("" when it has one: :func:`peer_name`)."""
    cfg = case.config
    if case.precision:
        return "the peers train float32/float64 models, not mixed precision"
    if cfg.mlp != "gelu" or cfg.kv_heads != cfg.heads or cfg.n_classes:
        return "the peers' model is the GELU, multi-head language model"
    if (case.recompute != "none" or case.checkpoint or case.attention != "plain"
            or case.sequence_parallel):
        return "the peers do not recompute, tile attention or split the sequence"
    if case.pp == 1 and case.tensor_size == 1 and case.zero == 0:
        return ""
    if case.pp == 1 and case.dp == 1 and case.scheme == "megatron":
        return ""
    return ("a peer runs pure data parallelism with ZeRO 0 (DDP) or pure Megatron "
            "tensor parallelism (DTensor)")


def peer_name(case) -> str:
    """``"DDP"`` or ``"DTensor"``: the peer of a case with no :func:`peer_reason`."""
    return "DDP" if case.tensor_size == 1 else "DTensor"


def _gpt_class():
    """The torch module of the GPT (built on first use: torch is optional)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from ..transformer.ops import LN_EPS

    class Block(nn.Module):
        def __init__(self, h, f, heads):
            super().__init__()
            self.hd = h // heads
            self.ln1, self.ln2 = nn.LayerNorm(h, eps=LN_EPS), nn.LayerNorm(h, eps=LN_EPS)
            self.q, self.k, self.v = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
            self.proj = nn.Linear(h, h)
            self.fc, self.out = nn.Linear(h, f), nn.Linear(f, h)

        def forward(self, x):
            b, t, _ = x.shape
            a = self.ln1(x)
            q, k, v = ((lin(a).view(b, t, -1, self.hd).transpose(1, 2))   # local heads
                       for lin in (self.q, self.k, self.v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
            return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        """summasim's serial GPT from its parameters (weights [in, out] become
        nn.Linear's [out, in]; the fused qkv splits into q, k, v)."""

        def __init__(self, params: dict, config):
            super().__init__()
            h, heads = config.hidden, config.heads

            def t(a):
                return torch.from_numpy(np.ascontiguousarray(a))

            self.wte = nn.Parameter(t(params["wte"]))
            self.wpe = nn.Parameter(t(params["wpe"]))
            self.blocks = nn.ModuleList()
            with torch.no_grad():
                for l in range(config.layers):
                    P = {k[len(f"h{l}."):]: v for k, v in params.items()
                         if k.startswith(f"h{l}.")}
                    blk = Block(h, P["mlp.fc.w"].shape[1], heads).to(self.wte.dtype)
                    for ln in ("ln1", "ln2"):
                        getattr(blk, ln).weight.copy_(t(P[ln + ".g"]))
                        getattr(blk, ln).bias.copy_(t(P[ln + ".b"]))
                    for i, name in enumerate(("q", "k", "v")):
                        lin = getattr(blk, name)
                        lin.weight.copy_(t(P["attn.qkv.w"][:, i * h:(i + 1) * h].T))
                        lin.bias.copy_(t(P["attn.qkv.b"][i * h:(i + 1) * h]))
                    for name, key in (("proj", "attn.proj"), ("fc", "mlp.fc"),
                                      ("out", "mlp.proj")):
                        getattr(blk, name).weight.copy_(t(P[key + ".w"].T))
                        getattr(blk, name).bias.copy_(t(P[key + ".b"]))
                    self.blocks.append(blk)
            self.lnf = nn.LayerNorm(h, eps=LN_EPS).to(self.wte.dtype)
            with torch.no_grad():
                self.lnf.weight.copy_(t(params["lnf.g"]))
                self.lnf.bias.copy_(t(params["lnf.b"]))
            self.head = (None if config.tied else
                         nn.Parameter(t(params["head.w"].T.copy())))

        def serial_grads(self) -> dict:
            """The gradients under summasim's serial keys and layouts ([in, out],
            fused qkv), as float64 NumPy arrays (collective under DTensor: a sharded
            gradient is gathered whole)."""
            def g(t, transpose=False):
                grad = t.grad
                if hasattr(grad, "full_tensor"):
                    grad = grad.full_tensor()
                a = grad.detach().double().numpy()
                return a.T if transpose else a

            out = {"wte": g(self.wte), "wpe": g(self.wpe)}
            for l, blk in enumerate(self.blocks):
                pre = f"h{l}."
                for ln in ("ln1", "ln2"):
                    out[pre + ln + ".g"] = g(getattr(blk, ln).weight)
                    out[pre + ln + ".b"] = g(getattr(blk, ln).bias)
                out[pre + "attn.qkv.w"] = np.concatenate(
                    [g(getattr(blk, n).weight, True) for n in "qkv"], axis=1)
                out[pre + "attn.qkv.b"] = np.concatenate([g(getattr(blk, n).bias)
                                                          for n in "qkv"])
                for name, key in (("proj", "attn.proj"), ("fc", "mlp.fc"),
                                  ("out", "mlp.proj")):
                    out[pre + key + ".w"] = g(getattr(blk, name).weight, True)
                    out[pre + key + ".b"] = g(getattr(blk, name).bias)
            out["lnf.g"], out["lnf.b"] = g(self.lnf.weight), g(self.lnf.bias)
            if self.head is not None:
                out["head.w"] = g(self.head, True)
            return out

        def forward(self, tokens, targets):
            x = self.wte[tokens] + self.wpe[: tokens.shape[1]]
            for blk in self.blocks:
                x = blk(x)
            logits = F.linear(self.lnf(x), self.wte if self.head is None else self.head)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return GPT


def process_group(world):
    """Initialize ``torch.distributed`` (gloo) on the ranks of ``world`` (collective):
    rank 0 opens a TCP store on a free port of its host, and the port and host reach
    the others over MPI. Returns ``torch.distributed``."""
    import datetime

    import torch.distributed as dist
    from mpi4py import MPI

    if dist.is_initialized():
        return dist
    rank, p = world.Get_rank(), world.Get_size()
    timeout = datetime.timedelta(seconds=STORE_TIMEOUT_S)
    store = err = None
    if rank == 0:
        try:
            store = dist.TCPStore("0.0.0.0", 0, p, True, timeout=timeout,
                                  wait_for_workers=False)
            where = (socket.gethostname(), store.port)
        except Exception as e:   # noqa: BLE001 -- raised on every rank below
            where, err = None, f"{type(e).__name__}: {e}"
    else:
        where = None
    where, err = world.bcast((where, err), root=0)
    if err:
        raise RuntimeError(f"torch.distributed: rank 0 could not open its store ({err})")
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    one_node = node.Get_size() == p
    node.Free()
    if rank:
        store = dist.TCPStore("127.0.0.1" if one_node else where[0], where[1], p, False,
                              timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=p, timeout=timeout)
    return dist


class Peer:
    """The PyTorch peer of ``case`` on ``world`` (collective), built and checked: the
    first loss and the first step's gradients (every micro-batch's backward, DDP's
    averages, DTensor's shards gathered) against the serial model's on the whole batch
    (:func:`summasim.transformer.model.backward`, rank 0), each parameter's relative
    error (Frobenius) within ``bound`` (:func:`summasim.validate.training_tolerance`,
    the mesh's own). That checked step is the peer's warm-up. Then :meth:`step` is one
    training step (to be timed, e.g. beside the mesh's:
    :func:`summasim.harness.composed.run_mesh`'s ``alongside``), and :meth:`finish`
    checks the replicated parameters bit-identical over the ranks and returns the
    verdict."""

    def __init__(self, case, world):
        import torch

        from ..harness.composed import LR, mesh_inputs
        from ..harness.transformer import loss_error
        from ..validate import training_tolerance

        self.world, self.torch = world, torch
        process_group(world)
        rank, p = world.Get_rank(), world.Get_size()
        torch.set_num_threads(1 if p > 1 else torch.get_num_threads())
        cfg, batch, m = case.config, case.batch, case.microbatches
        self.name = peer_name(case)
        self.bound = training_tolerance(cfg, batch, case.dtype)
        params, tokens, targets = mesh_inputs(cfg, batch, 0)
        self.model = model = _gpt_class()(params, cfg)
        ref = _serial_loss_and_grads(params, tokens, targets, cfg) if rank == 0 else None
        del params
        tokens, targets = torch.from_numpy(tokens), torch.from_numpy(targets)
        if self.name == "DDP":
            from torch.nn.parallel import DistributedDataParallel

            share = batch // p
            tokens, targets = (a[rank * share:(rank + 1) * share] for a in (tokens, targets))
            self.wrapped = DistributedDataParallel(model,
                                                   bucket_cap_mb=case.bucket_bytes / 2**20)
            self._sync_off = self.wrapped.no_sync
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.parallel import (ColwiseParallel,
                                                           RowwiseParallel,
                                                           parallelize_module)

            mesh = init_device_mesh("cpu", (p,))
            plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
                    "proj": RowwiseParallel(), "fc": ColwiseParallel(),
                    "out": RowwiseParallel()}
            for blk in model.blocks:
                parallelize_module(blk, mesh, plan)
            self.wrapped, self._sync_off = model, contextlib.nullcontext
        self.opt = torch.optim.Adam(model.parameters(), lr=LR, betas=(0.9, 0.999),
                                    eps=1e-8, foreach=False)
        self.tokens, self.targets, self.m = tokens, targets, m
        self.micro = tokens.shape[0] // m
        with torch.no_grad():                     # the same model on the same data
            first = float(model(tokens, targets))
        if self.name == "DDP":
            first = world.allreduce(first) / p    # equal shares: the global mean
        got = self.step(check=True)               # the warm-up step, checked
        errs = None
        if rank == 0:
            errs = (loss_error(first, ref[0]),) + _grad_error(got, ref[1])
        self.loss_error, self.grad_error, self.worst = world.bcast(errs, root=0)

    def step(self, check: bool = False):
        """One training step (collective): every micro-batch's forward and backward
        (DDP's all-reduces on the last), then Adam. ``check``: returns the gradients in
        summasim's serial keys, before the update."""
        self.opt.zero_grad(set_to_none=True)
        m, mb = self.m, self.micro
        for i in range(m):
            sl = slice(i * mb, (i + 1) * mb)
            with (self._sync_off() if i < m - 1 else contextlib.nullcontext()):
                (self.wrapped(self.tokens[sl], self.targets[sl]) / m).backward()
        got = self.model.serial_grads() if check else None
        self.opt.step()
        return got

    def finish(self) -> dict:
        """The replicated parameters compared over the ranks (collective); the verdict:
        ``{"peer", "loss_error", "grad_error", "worst", "bound", "replicas_agree",
        "ok", "torch"}``."""
        from mpi4py import MPI

        torch = self.torch
        replicated = [t for t in self.model.parameters() if not hasattr(t, "placements")]
        digest = float(sum(float(t.detach().double().sum()) for t in replicated))
        finite = all(bool(torch.isfinite(t.detach()).all()) for t in replicated)
        agree = len(set(self.world.allgather(digest))) == 1
        good = (self.loss_error <= self.bound and self.grad_error <= self.bound and agree
                and finite)
        ok = self.world.allreduce(int(good), op=MPI.MIN) == 1
        return {"peer": self.name, "loss_error": self.loss_error,
                "grad_error": self.grad_error, "worst": self.worst, "bound": self.bound,
                "replicas_agree": agree, "ok": ok, "torch": torch.__version__}


def _serial_loss_and_grads(params, tokens, targets, cfg) -> tuple[float, dict]:
    """The serial model's mean loss and its gradients on the whole batch."""
    from ..transformer import model as serial

    loss, cache = serial.forward(params, tokens, targets, cfg)
    return loss, serial.backward(cache)


def _grad_error(got: dict, ref: dict) -> tuple[float, str]:
    """The worst relative error (Frobenius) of ``got`` against ``ref`` over the keys of
    ``ref`` (NaN when a value is not finite, inf for a key ``got`` lacks), and its key."""
    worst, where = 0.0, ""
    for key, want in ref.items():
        if key not in got:
            return math.inf, key
        a, b = got[key], np.asarray(want, np.float64)
        if not np.isfinite(a).all():
            return math.nan, key
        e = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), np.finfo(float).tiny))
        if e > worst or not where:
            worst, where = e, key
    return worst, where


def close() -> None:
    """End ``torch.distributed``'s group, if one was opened."""
    try:
        import torch.distributed as dist
    except ImportError:
        return
    if dist.is_initialized():
        dist.destroy_process_group()

"""The serial GPT-2 style reference model, built from :mod:`summasim.transformer.ops`.

Every parallel scheme (Megatron 1D, Optimus 2D, SUMMA2.5-LM) is checked against
this model: loss, logits and every gradient.

Parameters are a flat dict with serial shapes, weights stored ``[in, out]``::

    wte [v, h], wpe [s, h],
    h{l}.ln1.g [h], h{l}.ln1.b [h], h{l}.attn.qkv.w [h, W], h{l}.attn.qkv.b [W],
    h{l}.attn.proj.w [h, h], h{l}.attn.proj.b [h], h{l}.ln2.g [h], h{l}.ln2.b [h],
    h{l}.mlp.fc.w [h, F], h{l}.mlp.fc.b [F],
    (SwiGLU only: h{l}.mlp.gate.w [h, F], h{l}.mlp.gate.b [F])
    h{l}.mlp.proj.w [F, h], h{l}.mlp.proj.b [h],
    lnf.g [h], lnf.b [h],
    (untied LM head only: head.w [h, v])   (classifier only: cls.w [h, k], cls.b [k])

with ``F = round(ffn_mult h)`` (:attr:`Config.ffn`) and ``W = h + 2 kv_width`` the QKV
width (``3h`` without grouped-query attention; columns ``[Q | K | V]``, Q holding all
``heads`` query heads, K and V ``kv_heads`` heads each).

Variants, all from the :class:`summasim.spec.Model` fields: ``mlp="swiglu"``
(``proj(silu(gate(x)) * fc(x))``, Shazeer 2020), ``kv_heads < heads`` (grouped-query
attention, Ainslie et al. 2023) and ``tied=False`` (the LM head is its own
``head.w``, ``logits = x @ head.w``, and no longer reads ``wte``).

``forward(params, tokens, targets, config)`` returns the mean cross-entropy over
the ``b*s`` tokens, or, with ``n_classes > 0``, the mean cross-entropy over the
``b`` sequences of a classifier reading the last token. ``backward(cache)`` is the
forward read in reverse, seeded with ``1/(b*s)`` (``1/b`` for classification).
``forward`` takes how to train: ``recompute`` none | selective | full and ``attention``
plain | flash; the gradients do not depend on ``recompute`` (bitwise) and depend on
``attention`` only by round-off. :func:`activation_items` counts what the caches hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import numpy as np

from summasim.backends import array_module
from summasim.spec import ATTENTIONS, RECOMPUTE, Model, positive_int

from . import ops

INIT_STD = 0.02


@dataclass(frozen=True)
class Config(Model):
    """A :class:`summasim.spec.Model` (vocab, seq, hidden, heads, layers, ffn_mult and the
    keyword-only variant fields mlp, kv_heads, tied) as the runtime trains it: with its
    element type and an optional classification head.

    dtype (float32 or float64), n_classes (0: language model; k > 0: classify each
    sequence from its last token into k classes with ``cls.w``/``cls.b``; there is then
    no LM head, tied or not). Validates itself; errors name the offending field.
    ``Config.of(model, dtype)`` builds one from a model.
    """

    dtype: Any = np.float64
    n_classes: int = 0

    def __post_init__(self):
        super().__post_init__()
        nc = self.n_classes
        if isinstance(nc, bool) or not isinstance(nc, (int, np.integer)) or nc < 0:
            raise ValueError(f"Config.n_classes must be a non-negative integer, got {nc!r}")
        try:
            dt = np.dtype(self.dtype)
        except TypeError:
            dt = None
        if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise ValueError(f"Config.dtype must be float32 or float64, got {self.dtype!r}")
        object.__setattr__(self, "dtype", dt)

    @classmethod
    def of(cls, model: Model, dtype=np.float64, n_classes: int = 0) -> "Config":
        """The runtime's configuration of ``model`` in ``dtype``."""
        return cls(model.vocab, model.seq, model.hidden, model.heads, model.layers,
                   model.ffn_mult, dtype, n_classes, mlp=model.mlp, kv_heads=model.kv_heads,
                   tied=model.tied, name=model.name, batch=model.batch, source=model.source)

    @property
    def model(self) -> Model:
        """The sizes and variant alone, as a :class:`summasim.spec.Model`."""
        return Model(self.vocab, self.seq, self.hidden, self.heads, self.layers,
                     self.ffn_mult, mlp=self.mlp, kv_heads=self.kv_heads, tied=self.tied,
                     name=self.name, batch=self.batch, source=self.source)

    @property
    def ffn(self) -> int:
        """The MLP width f h (:attr:`ffn_width`)."""
        return self.ffn_width


def need_config(config) -> None:
    """``TypeError`` unless ``config`` is a :class:`Config` (a :class:`summasim.spec.Model`
    describes the model for every floor; the runtime's ``Config.of(model, dtype)`` adds
    what the arrays need)."""
    if not isinstance(config, Config):
        hint = (" (Config.of(model, dtype) makes one from a spec.Model)"
                if isinstance(config, Model) else "")
        raise TypeError(f"config must be a summasim.transformer.model.Config, got "
                        f"{type(config).__name__}{hint}")


def param_shapes(config: Config) -> dict:
    """Ordered ``{name: shape}`` of every parameter, serial shapes."""
    need_config(config)
    h, f, w = config.hidden, config.ffn, config.qkv_width
    shapes = {"wte": (config.vocab, h), "wpe": (config.seq, h)}
    layer = {"ln1.g": (h,), "ln1.b": (h,), "attn.qkv.w": (h, w), "attn.qkv.b": (w,),
             "attn.proj.w": (h, h), "attn.proj.b": (h,), "ln2.g": (h,), "ln2.b": (h,),
             "mlp.fc.w": (h, f), "mlp.fc.b": (f,), "mlp.gate.w": (h, f), "mlp.gate.b": (f,),
             "mlp.proj.w": (f, h), "mlp.proj.b": (h,)}
    for l in range(config.layers):
        for key in ops.block_keys(config.mlp):
            shapes[f"h{l}.{key}"] = layer[key]
    shapes["lnf.g"] = (h,)
    shapes["lnf.b"] = (h,)
    if not config.tied and not config.n_classes:
        shapes["head.w"] = (h, config.vocab)        # the untied LM head, [in, out]
    if config.n_classes:
        shapes["cls.w"] = (h, config.n_classes)
        shapes["cls.b"] = (config.n_classes,)
    return shapes


def init_params(config: Config, seed: int = 0) -> dict:
    """GPT-2 initialisation: weights N(0, 0.02) (``mlp.gate.w`` and ``head.w`` too), the
    two residual projections (``attn.proj.w``, ``mlp.proj.w``) scaled by
    ``1/sqrt(2*layers)``, LayerNorm ``g = 1, b = 0``, biases 0. Values are drawn in
    float64 and then cast, so a float32 model holds the rounded float64 parameters of
    the same seed.
    """
    shapes = param_shapes(config)              # (checks that config is a Config)
    rng = np.random.default_rng(seed)
    proj_std = INIT_STD / math.sqrt(2 * config.layers)
    params = {}
    for name, shape in shapes.items():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith((".ln1.g", ".ln2.g")) or name == "lnf.g":
            val = np.ones(shape)
        elif leaf == "b":
            val = np.zeros(shape)
        elif name.endswith(("attn.proj.w", "mlp.proj.w")):
            val = rng.normal(0.0, proj_std, shape)
        else:   # wte, wpe, qkv.w, fc.w, gate.w, head.w, cls.w
            val = rng.normal(0.0, INIT_STD, shape)
        params[name] = val.astype(config.dtype)
    return params


def layer_params(params: dict, layer: int) -> dict:
    """Layer ``layer``'s parameters under the block's local keys (``"ln1.g"``, ...;
    :func:`ops.block_keys`, SwiGLU's when the layer has ``mlp.gate.w``)."""
    prefix = f"h{layer}."
    mlp = "swiglu" if prefix + "mlp.gate.w" in params else "gelu"
    return {key: params[prefix + key] for key in ops.block_keys(mlp)}


def stage_keys(config: Config, layers, first: bool, last: bool) -> list:
    """The parameter keys a pipeline stage owns, in forward order.

    ``wte``, ``wpe`` if ``first`` (the embedding); ``h{l}.*`` for each ``l`` of
    ``layers`` (a contiguous ascending range of layer indices); if ``last``,
    ``lnf.g``, ``lnf.b`` and the head: ``cls.w``, ``cls.b`` for classification, the
    untied ``head.w`` when ``config.tied`` is False, else the tied ``wte`` (listed once:
    on a stage that is also the first it is already there). Over the stages of a split
    every key appears once, except the tied ``wte`` of a language model, which the
    first and the last stage both hold when they differ.
    """
    layers = [int(l) for l in layers]
    if layers and (layers != list(range(layers[0], layers[0] + len(layers)))
                   or not 0 <= layers[0] <= layers[-1] < config.layers):
        raise ValueError(f"stage layers must be a contiguous ascending range inside "
                         f"[0, Config.layers={config.layers}), got {layers}")
    keys = ["wte", "wpe"] if first else []
    for l in layers:
        keys += [f"h{l}.{key}" for key in ops.block_keys(config.mlp)]
    if last:
        keys += ["lnf.g", "lnf.b"]
        if config.n_classes:
            keys += ["cls.w", "cls.b"]
        elif not config.tied:
            keys.append("head.w")       # the untied LM head
        elif not first:
            keys.append("wte")          # the tied LM head's copy of the embedding
    return keys


# --------------------------------------------------------------------------- #
# validation                                                                  #
# --------------------------------------------------------------------------- #
def _is_integer_array(a) -> bool:
    return hasattr(a, "dtype") and hasattr(a, "shape") and a.dtype.kind in "iu"


def check_params(params: dict, config: Config) -> None:
    """Raise ValueError unless ``params`` has exactly the config's names, shapes and dtype."""
    if not isinstance(params, dict):
        raise TypeError(f"params must be a dict of arrays, got {type(params).__name__}")
    shapes = param_shapes(config)
    missing = [k for k in shapes if k not in params]
    extra = [k for k in params if k not in shapes]
    if missing or extra:
        raise ValueError(f"params do not match the config: missing {missing[:5]}"
                         f"{'...' if len(missing) > 5 else ''}, unexpected {extra[:5]}"
                         f"{'...' if len(extra) > 5 else ''}")
    for name, shape in shapes.items():
        arr = params[name]
        if tuple(getattr(arr, "shape", ())) != shape:
            raise ValueError(f"params[{name!r}] has shape {tuple(getattr(arr, 'shape', ()))}, "
                             f"expected {shape}")
        if getattr(arr, "dtype", None) != config.dtype:
            raise ValueError(f"params[{name!r}] has dtype {getattr(arr, 'dtype', None)} but "
                             f"Config.dtype is {config.dtype}")


def check_tokens(tokens, config: Config, name: str = "tokens") -> None:
    """Raise ValueError unless ``tokens`` is an integer [b, s] array, 1 <= s <= seq,
    with ids in [0, vocab)."""
    if not _is_integer_array(tokens):
        raise ValueError(f"{name} must be an integer array of shape [b, s], got "
                         f"{type(tokens).__name__} with dtype {getattr(tokens, 'dtype', None)}")
    if tokens.ndim != 2 or tokens.shape[0] < 1 or not 1 <= tokens.shape[1] <= config.seq:
        raise ValueError(f"{name} must have shape [b, s] with b >= 1 and 1 <= s <= "
                         f"Config.seq={config.seq}, got {tuple(tokens.shape)}")
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= config.vocab:
        raise ValueError(f"{name} hold ids outside [0, Config.vocab={config.vocab}): "
                         f"min {lo}, max {hi}")


def check_targets(targets, tokens, config: Config) -> None:
    """LM: targets like tokens; classification: integer [b] in [0, n_classes)."""
    if not config.n_classes:
        if getattr(targets, "shape", None) != tokens.shape:
            raise ValueError(f"targets must have the shape of tokens {tuple(tokens.shape)}, "
                             f"got {getattr(targets, 'shape', None)}")
        check_tokens(targets, config, name="targets")
        return
    b = tokens.shape[0]
    if not _is_integer_array(targets) or targets.shape != (b,):
        raise ValueError(f"targets for classification must be an integer array of shape "
                         f"({b},), got {getattr(targets, 'shape', None)} "
                         f"{getattr(targets, 'dtype', None)}")
    lo, hi = int(targets.min()), int(targets.max())
    if lo < 0 or hi >= config.n_classes:
        raise ValueError(f"targets hold classes outside [0, Config.n_classes="
                         f"{config.n_classes}): min {lo}, max {hi}")


# --------------------------------------------------------------------------- #
# forward / backward                                                          #
# --------------------------------------------------------------------------- #
class ModelCache(NamedTuple):
    config: Config
    params: dict                 # read again when checkpointed layers are recomputed
    checkpoint: bool             # recompute == "full"
    emb: ops.EmbeddingCache
    blocks: list                 # per layer: BlockCache, or its input (B, T, h) if "full"
    lnf: ops.LayerNormCache
    head: Any                    # LMHeadCache (tied), LinearCache (untied head.w), or
    #                              ClassifierCache when n_classes > 0
    ce: Optional[ops.CrossEntropyCache]   # None when no targets were given
    logits: Any                  # (B, T, v), or (B, n_classes)
    loss: Optional[float]
    n_items: int                 # tokens (LM) or sequences (classification) in the mean
    recompute: str = "none"      # "none", "selective" or "full"
    attention: str = "plain"     # "plain" or "flash"
    tile: Optional[int] = None   # flash's key/value tile (None: flash's default)


def _recompute_mode(checkpoint, recompute) -> str:
    """``recompute`` resolved with the older ``checkpoint`` flag (True means "full")."""
    if recompute is None:
        return "full" if checkpoint else "none"
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    if checkpoint and recompute != "full":
        raise ValueError(f"checkpoint=True is recompute='full'; it contradicts "
                         f"recompute={recompute!r}")
    return recompute


def _block_kwargs(config: Config, attention: str, tile) -> dict:
    """The variant keywords every layer of ``config`` passes to ``ops.block_forward``."""
    return dict(kv_heads=config.kv_heads, mlp=config.mlp, attention=attention, tile=tile)


def forward(params: dict, tokens, targets, config: Config, checkpoint: bool = False, *,
            recompute: Optional[str] = None, attention: str = "plain",
            tile: Optional[int] = None):
    """Loss and cache of the model on ``tokens`` [b, s].

    ``targets``: [b, s] next-token ids (LM), [b] classes (``n_classes > 0``), or
    None (only the logits; :func:`backward` then refuses).

    ``recompute`` (default ``"full"`` if ``checkpoint`` else ``"none"``; a contradiction
    raises ValueError):

    ``"none"``       every layer keeps its whole cache;
    ``"selective"``  every layer keeps its cache but the attention core's (T, T)
                     probabilities and ``q * scale``, recomputed in the backward from the
                     kept q, k, v (Korthikanti et al. 2022, section 4.2);
    ``"full"``       each layer keeps only its input and is recomputed during the
                     backward (``checkpoint=True``).

    ``attention``: ``"plain"`` or ``"flash"`` (blockwise, online softmax; ``tile`` its
    key/value tile, default flash's). Returns ``(loss, cache)``; ``loss`` is a Python
    float (None without targets) and ``cache.logits`` holds the logits.
    """
    recompute = _recompute_mode(checkpoint, recompute)
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
    check_params(params, config)
    check_tokens(tokens, config)
    if targets is not None:
        check_targets(targets, tokens, config)
    kw = _block_kwargs(config, attention, tile)
    x, emb = ops.embedding_forward(tokens, params["wte"], params["wpe"])   # (B, T, h)
    blocks = []
    for l in range(config.layers):
        p = layer_params(params, l)
        if recompute == "full":
            blocks.append(x)                           # keep the input only
            x, _ = ops.block_forward(x, p, config.heads, **kw)
        else:
            x, cache = ops.block_forward(x, p, config.heads, recompute=recompute,
                                         **kw)        # (B, T, h)
            blocks.append(cache)
    x, lnf = ops.layernorm_forward(x, params["lnf.g"], params["lnf.b"])  # (B, T, h)
    if config.n_classes:
        logits, head = ops.classifier_forward(x, params["cls.w"], params["cls.b"])  # (B, k)
    elif config.tied:
        logits, head = ops.lm_head_forward(x, params["wte"])                       # (B, T, v)
    else:
        logits, head = ops.linear_forward(x, params["head.w"])                     # (B, T, v)
    n_items = math.prod(logits.shape[:-1])
    loss, ce = None, None
    if targets is not None:
        losses, ce = ops.cross_entropy_forward(logits, targets)   # (B, T) or (B,)
        loss = float(losses.sum()) / n_items
    return loss, ModelCache(config=config, params=params, checkpoint=recompute == "full",
                            emb=emb, blocks=blocks, lnf=lnf, head=head, ce=ce, logits=logits,
                            loss=loss, n_items=n_items, recompute=recompute,
                            attention=attention, tile=tile)


def backward(cache: ModelCache, parts: Optional[dict] = None, *,
             loss_scale: float = 1.0) -> dict:
    """Gradients of the mean loss, same keys (and order) as the params.

    The forward read in reverse. ``parts``, if a dict, receives the two
    contributions to the tied ``wte`` gradient, ``"wte.embed"`` and ``"wte.head"``
    (the latter for a tied LM head only), for checks. ``loss_scale`` S seeds the
    backward with S times the mean loss's gradient (mixed precision's loss scaling):
    the gradients come out multiplied by S.
    """
    if cache.ce is None:
        raise ValueError("backward needs a forward with targets")
    if not (isinstance(loss_scale, (int, float)) and math.isfinite(loss_scale)
            and loss_scale > 0):
        raise ValueError(f"loss_scale must be a finite positive number, got {loss_scale!r}")
    config, params = cache.config, cache.params
    xp = array_module(cache.logits)
    grads = {}
    dlosses = xp.full(cache.logits.shape[:-1], float(loss_scale) / cache.n_items,
                      dtype=cache.logits.dtype)       # dloss = 1/(b*s) per token
    dlogits, _ = ops.cross_entropy_backward(dlosses, cache.ce)    # like the logits
    dwte_head = None
    if config.n_classes:
        dx, g = ops.classifier_backward(dlogits, cache.head)    # (B, T, h)
        grads["cls.w"], grads["cls.b"] = g["w"], g["b"]
    elif config.tied:
        dx, g = ops.lm_head_backward(dlogits, cache.head)       # (B, T, h)
        dwte_head = g["wte"]
    else:
        dx, g = ops.linear_backward(dlogits, cache.head)        # (B, T, h)
        grads["head.w"] = g["w"]                                # (h, v); wte is not read
    dx, g = ops.layernorm_backward(dx, cache.lnf)               # (B, T, h)
    grads["lnf.g"], grads["lnf.b"] = g["g"], g["b"]
    kw = _block_kwargs(config, cache.attention, cache.tile)
    for l in reversed(range(config.layers)):
        if cache.recompute == "full":   # recompute the layer's forward from its saved input
            _, block = ops.block_forward(cache.blocks[l], layer_params(params, l),
                                         config.heads, **kw)
        else:
            block = cache.blocks[l]
        dx, g = ops.block_backward(dx, block)                   # (B, T, h)
        del block
        for key, val in g.items():
            grads[f"h{l}.{key}"] = val
    _, g = ops.embedding_backward(dx, cache.emb)
    grads["wpe"] = g["wpe"]
    if dwte_head is None:
        grads["wte"] = g["wte"]
    else:
        grads["wte"] = g["wte"] + dwte_head                     # tied: embedding + LM head
    if parts is not None:
        parts["wte.embed"] = g["wte"]
        if dwte_head is not None:
            parts["wte.head"] = dwte_head
    return {key: grads[key] for key in params}


def logits(params: dict, tokens, config: Config, *, attention: str = "plain"):
    """The logits, (b, s, vocab) for the LM or (b, n_classes) for classification."""
    return forward(params, tokens, None, config, attention=attention)[1].logits


def loss_and_grads(params: dict, tokens, targets, config: Config, checkpoint: bool = False,
                   **kw):
    """``(loss, grads)``: forward (``recompute``, ``attention``, ``tile`` as there) then
    backward."""
    loss, cache = forward(params, tokens, targets, config, checkpoint=checkpoint, **kw)
    return loss, backward(cache)


# --------------------------------------------------------------------------- #
# activation memory                                                           #
# --------------------------------------------------------------------------- #
class ActivationItems(NamedTuple):
    """Array items the caches of :func:`forward` hold for :func:`backward`
    (floating items in ``Config.dtype``, except ``ids``)."""
    embedding: int       # 0: the embedding keeps only the token ids (in ``ids``)
    layer: int           # one layer
    layer_terms: dict    # ``layer`` op by op: {what is held: items}
    layers: int          # every layer: layers * layer
    head: int            # final LayerNorm, the head's input and the logits
    loss: int            # the cross-entropy's probabilities
    total: int           # embedding + layers + head + loss
    ids: int             # integer items: token ids (embedding) and target ids (loss)


def activation_items(config: Config, batch: int, seq: int, recompute: str = "none",
                     attention: str = "plain") -> ActivationItems:
    """What :func:`forward` (with targets) keeps for :func:`backward`, in array items.

    Derived op by op from what each cache saves (``ops``), with ``N = b s`` tokens,
    hidden ``h``, MLP width ``F``, QKV width ``W = h + 2 kv_width`` (3h without GQA),
    ``n`` query heads, vocabulary ``v``. Arrays that several caches share (a view of
    one buffer) count once; parameters do not count.

    One layer, ``recompute`` "none" or "selective":

    ==================  ==========================================  ===============
    op                  cache keeps                                 items
    ==================  ==========================================  ===============
    ln1, ln2            xhat and rstd each                          2 (N h + N)
    QKV linear          its input, ln1's output                     N h
    QKV output          one buffer; q, k, v are views of it         N W
    core, plain         ``q * scale`` and the probabilities         N h + b n s^2
    core, selective     nothing more (recomputed in the backward)   0
    core, flash         the row log-sum-exp                         b n s
    attn output linear  its input, the merged heads y (also the     N h
                        core's output)
    fc (and gate)       their input, ln2's output                   N h
    GELU MLP            fc's output (GELU input), GELU output       2 N F
    SwiGLU MLP          up and gate outputs, the gated product      3 N F
    ==================  ==========================================  ===============

    so a GELU, plain, "none" layer holds ``N (6h + W + 2F + 2) + b n s^2`` items: for
    GPT's W = 3h, F = 4h, ``17 s b h + 2 s b + a s^2 b``. ``recompute="full"``: a layer
    keeps its input only, ``N h``.

    Around the layers: the embedding keeps the token ids (``N`` ids, the caller's
    array) and no floats (its output is the first layer's input, kept by that layer
    under "full" only); the head keeps the final LayerNorm's xhat and rstd, its output
    (the LM head's or classifier's input; the classifier's last-token rows are a view of
    it) and the logits (kept in ``ModelCache.logits`` for callers; the backward does not
    read them): ``2 N h + N + N v`` (``+ b k`` logits instead of ``N v`` for a
    classifier); the loss keeps the probabilities (``N v``, or ``b k``) and the target
    ids (``N``, or ``b``).

    Relation to Korthikanti et al. 2022, eq. (1) and section 4.2: their layer keeps
    ``34 s b h + 5 a s^2 b`` bytes with 2-byte activations and 1-byte dropout masks,
    i.e. ``16 s b h + 2 a s^2 b`` 16-bit items plus ``2 s b h + a s^2 b`` mask bytes.
    summasim has no dropout (no masks, no dropout output ``a s^2 b``), and adds the
    scaled queries (``s b h``, the plain core's ``q * scale``) and the LayerNorms'
    ``rstd`` (``2 s b``); it keeps xhat where they keep the LayerNorm input (same size).
    Selective: their ``34 s b h`` bytes = ``16 s b h`` items + ``2 s b h`` mask bytes,
    summasim's ``16 s b h + 2 s b``. Full: their ``2 s b h`` bytes = summasim's ``s b h``.
    """
    batch, seq = positive_int("batch", batch), positive_int("seq", seq)
    recompute = _recompute_mode(False, recompute)
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
    n_tok, h, f = batch * seq, config.hidden, config.ffn
    scores = batch * config.heads * seq * seq
    if recompute == "full":
        terms = {"input": n_tok * h}
    else:
        terms = {"ln1": n_tok * h + n_tok, "attn.qkv.in": n_tok * h,
                 "attn.qkv.out": n_tok * config.qkv_width}
        if attention == "flash":
            terms["attn.core"] = batch * config.heads * seq          # lse
        elif recompute == "none":
            terms["attn.core"] = n_tok * h + scores                  # q * scale, probs
        else:
            terms["attn.core"] = 0                                   # selective
        terms.update({"attn.proj.in": n_tok * h, "ln2": n_tok * h + n_tok,
                      "mlp.in": n_tok * h,
                      "mlp.act": (3 if config.mlp == "swiglu" else 2) * n_tok * f})
    layer = sum(terms.values())
    outs = batch * config.n_classes if config.n_classes else n_tok * config.vocab
    head = 2 * n_tok * h + n_tok + outs           # lnf xhat, rstd, its output, the logits
    loss = outs                                   # probabilities
    ids = n_tok + (batch if config.n_classes else n_tok)
    layers = config.layers * layer
    return ActivationItems(embedding=0, layer=layer, layer_terms=terms, layers=layers,
                           head=head, loss=loss, total=layers + head + loss, ids=ids)

"""The command-line options every command shares, declared once (pure: argparse only).

Every command spells the same thing the same way:

``--model NAME|h=H,heads=N,layers=L,seq=S,vocab=V[,ffn=F]``  a :class:`~summasim.spec.Model`
``--batch B``             global batch, in sequences
``--mesh dp=D,pp=P,tp=SCHEME:GRID``                           a :class:`~summasim.spec.Mesh`
``--zero``, ``--schedule``, ``--microbatches``, ``--stages``, ``--recompute``
(``--checkpoint``), ``--attention``, ``--sequence-parallel``, ``--loss-scale``,
``--grad-reduce``          how a mesh trains: a :class:`~summasim.spec.Training`
``--machine FILE|PRESET``  the cost model's machine: a fitted JSON file or a preset name
``--dtype``               element type

``run``, ``bench``, ``predict``, ``plan`` and ``explore`` add these with the functions
below; the values arrive parsed (a ``Model``, a ``Mesh``), so no command parses them again.
"""

from __future__ import annotations

import argparse

from . import spec


def _typed(parse, what: str):
    """An argparse ``type`` that turns ``parse``'s ``ValueError`` into one clear line."""
    def convert(text):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = what
    return convert


model_type = _typed(spec.Model.parse, "model")
mesh_type = _typed(spec.Mesh.parse, "mesh")
tensor_grid_type = _typed(spec.TensorGrid.parse, "tensor grid")


def _positive(text) -> int:
    from .cli import positive_int

    return positive_int(text)


def add_model(ap, default: str | None = None, help_more: str = ""):
    """``--model NAME|h=...,heads=...,layers=...,seq=...,vocab=...,ffn=...``."""
    presets = ", ".join(spec.MODELS)
    ap.add_argument("--model", type=model_type, default=default, metavar="NAME|SIZES",
                    help=f"the transformer: a preset ({presets}) or {spec.MODEL_FORM} "
                         f"(ffn: MLP multiplier, default 4); a preset may take overrides, "
                         f"e.g. gpt3-175b,layers=8"
                         + (f" (default {default})" if default else "") + help_more)


def add_batch(ap, default: int | None = None, help_more: str = ""):
    """``--batch B``: the global batch in sequences."""
    ap.add_argument("--batch", type=_positive, default=default, metavar="B",
                    help="global batch, sequences per step"
                         + (f" (default {default})" if default else
                            " (default: the model preset's published batch)") + help_more)


def add_mesh(ap, repeat: bool = False, help_more: str = ""):
    """``--mesh dp=D,pp=P,tp=SCHEME:GRID`` (repeatable where a command runs several)."""
    ap.add_argument("--mesh", type=mesh_type, action="append" if repeat else "store",
                    default=None, metavar="dp=D,pp=P,tp=SCHEME:GRID",
                    help=f"a training mesh of data, pipeline and tensor parallelism; "
                         f"SCHEME:GRID is {spec.TP_FORMS}; dp and pp default to 1, tp to "
                         f"megatron:1" + ("; repeatable" if repeat else "") + help_more)


def _schedule_text(text) -> str:
    kind, chunks = spec.parse_schedule(text)
    return f"{kind}:{chunks}" if kind == "interleaved" else kind


schedule_type = _typed(_schedule_text, "schedule")
stages_type = _typed(spec.parse_stages, "stages")
loss_scale_type = _typed(spec.parse_loss_scale, "loss scale")


class _StoreGiven(argparse._StoreAction):
    """``store``, and the flag's ``dest`` added to ``namespace.given_flags``: a flag
    given at its default value was still given (``--zero 0`` without ``--mesh``)."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        namespace.given_flags = set(getattr(namespace, "given_flags", ())) | {self.dest}


def given_flags(args) -> set:
    """The ``dest`` of every flag of :func:`add_training` given on the command line
    (whatever its value)."""
    return set(getattr(args, "given_flags", ()))


def add_training(ap, zero=0, schedule="1f1b", microbatches=None, microbatches_help=""):
    """How a mesh trains (a :class:`summasim.spec.Training`; build it with
    :func:`training`): ``--zero``, ``--schedule gpipe|1f1b|interleaved:V``,
    ``--microbatches``, ``--stages``, ``--recompute none|selective|full`` (``--checkpoint``
    is ``--recompute full``), ``--attention plain|flash``, ``--sequence-parallel``,
    ``--loss-scale`` and ``--grad-reduce`` (mixed precision). ``microbatches_help``
    ends ``--microbatches``'s help (a default the caller applies itself)."""
    ap.add_argument("--zero", type=int, action=_StoreGiven, choices=spec.ZERO_STAGES,
                    default=zero,
                    help=f"ZeRO stage (default {zero})")
    ap.add_argument("--schedule", type=schedule_type, action=_StoreGiven, default=schedule,
                    metavar="gpipe|1f1b|interleaved:V",
                    help=f"pipeline schedule; interleaved:V runs V model chunks per stage "
                         f"(default {schedule})")
    ap.add_argument("--microbatches", type=_positive, default=microbatches, metavar="M",
                    help="micro-batches per replica"
                         + (f" (default {microbatches})" if microbatches else "")
                         + microbatches_help)
    ap.add_argument("--stages", type=stages_type, default=None, metavar="L0,L1,...",
                    help="layers per pipeline stage (per stage and chunk when "
                         "interleaved), in order; 0 makes a stage of the embedding or of "
                         "the head alone (default: an even split)")
    ap.add_argument("--recompute", choices=spec.RECOMPUTE, action=_StoreGiven, default=None,
                    help="activation recompute: none, selective (only the attention core) "
                         "or full (each layer from its input) (default none)")
    ap.add_argument("--checkpoint", action="store_true",
                    help="the same as --recompute full")
    ap.add_argument("--attention", choices=spec.ATTENTIONS, action=_StoreGiven,
                    default="plain",
                    help="plain (holds the b n s^2 scores) or flash (blockwise, online "
                         "softmax) (default plain)")
    ap.add_argument("--sequence-parallel", action="store_true",
                    help="Megatron sequence parallelism: LayerNorm, dropout and the "
                         "residual on 1/t of the sequence; reduce-scatter and all-gather "
                         "in place of the all-reduces")
    ap.add_argument("--loss-scale", type=loss_scale_type, default=None,
                    metavar="dynamic|static:S|none",
                    help="loss scaling under mixed precision (default dynamic for "
                         "float16, none for bfloat16)")
    ap.add_argument("--grad-reduce", choices=spec.GRAD_REDUCE_DTYPES, default=None,
                    help="type of the data-parallel gradient reduction under mixed "
                         "precision (default float32)")


def without_mesh(t: spec.Training, microbatches_given: bool, given: set = frozenset()) -> str:
    """The user error of flags that say how a ``--mesh`` trains, given without one (the
    default compositions train with their own settings), or "" when there are none.
    ``given``: the flags given on the command line (:func:`given_flags`), so that one
    given at its default value (``--zero 0``) is refused too."""
    named = [flag for flag, on in (
        ("--zero", t.zero != 0 or "zero" in given),
        ("--schedule", t.schedule_label != "1f1b" or "schedule" in given),
        ("--microbatches", microbatches_given), ("--stages", t.stages is not None),
        ("--recompute/--checkpoint", t.recompute != "none" or "recompute" in given),
        ("--attention", t.attention != "plain" or "attention" in given),
        ("--sequence-parallel", t.sequence_parallel)) if on]
    return (f"{', '.join(named)} set(s) how a --mesh trains; give --mesh (the default "
            f"compositions train with their own settings)" if named else "")


def training(args, dtype: str | None = None) -> spec.Training:
    """The :class:`summasim.spec.Training` that :func:`add_training`'s flags name
    (``dtype``: the element type, when the command's ``--dtype`` is not it);
    ``ValueError`` on a contradiction (``--checkpoint`` with another ``--recompute``,
    ``--loss-scale`` without mixed precision, ...)."""
    recompute = args.recompute or ("full" if args.checkpoint else "none")
    if args.checkpoint and recompute != "full":
        raise ValueError(f"--checkpoint is --recompute full; it contradicts --recompute "
                         f"{args.recompute}")
    kind, chunks = spec.parse_schedule(args.schedule)
    if dtype is None:
        dtype = getattr(args, "dtype", None)
    return spec.Training(zero=args.zero, schedule=kind, chunks=chunks,
                         microbatches=args.microbatches, stages=args.stages,
                         recompute=recompute, attention=args.attention,
                         sequence_parallel=args.sequence_parallel,
                         dtype=dtype if dtype in spec.DTYPES else None,
                         loss_scale=args.loss_scale, grad_reduce=args.grad_reduce)


def add_steps(ap, default: int = 3, most: int = 10_000):
    """``--steps N``: training steps (at most ``most``)."""
    from .cli import int_between

    ap.add_argument("--steps", type=int_between(1, most), default=default, metavar="N",
                    help=f"training steps, each validated (default {default}, at most "
                         f"{most})")


def add_machine(ap, default: str | None = None, help_more: str = ""):
    """``--machine FILE|PRESET[:key=value,...]``: resolved by
    ``summasim.costmodel.machine.load_machine``."""
    ap.add_argument("--machine", default=default, metavar="FILE|PRESET",
                    help="cost-model machine: a preset name or a JSON file written by "
                         "`python -m summasim.costmodel fit`, optionally with changes, "
                         "e.g. dgx-a100:memory=40GiB,nics=4 (docs/presets.md)"
                         + (f" (default {default})" if default else "") + help_more)


def check_machine_used(args) -> None:
    """``--machine`` with ``--no-predict``: the machine would price nothing and a bad
    file would pass unread; a :class:`~summasim.cli.UsageError`."""
    if getattr(args, "no_predict", False) and getattr(args, "machine", None) is not None:
        from .cli import UsageError

        raise UsageError("--machine prices the runs and --no-predict prices none; leave "
                         "one of them out")


def add_dtype(ap, choices=("float64", "float32"), default: str | None = "float64",
              help_more=""):
    """``--dtype``: the element type (``default=None``: the command picks one and
    ``help_more`` says how)."""
    ap.add_argument("--dtype", choices=choices, default=default,
                    help="element type" + (f" (default {default})" if default else "")
                         + help_more)

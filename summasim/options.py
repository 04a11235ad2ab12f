"""The command-line options every command shares, declared once (pure: argparse only).

Every command spells the same thing the same way:

``--model NAME|h=H,heads=N,layers=L,seq=S,vocab=V[,ffn=F]``  a :class:`~summasim.spec.Model`
``--batch B``             global batch, in sequences
``--mesh dp=D,pp=P,tp=SCHEME:GRID``                           a :class:`~summasim.spec.Mesh`
``--zero``, ``--schedule``, ``--microbatches``, ``--checkpoint``  how a mesh trains
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


def add_composition(ap, zero=0, schedule="1f1b", microbatches=None, checkpoint=False):
    """How a mesh trains: ``--zero``, ``--schedule``, ``--microbatches``, ``--checkpoint``."""
    ap.add_argument("--zero", type=int, choices=spec.ZERO_STAGES, default=zero,
                    help=f"ZeRO stage (default {zero})")
    ap.add_argument("--schedule", choices=spec.SCHEDULES, default=schedule,
                    help=f"pipeline schedule (default {schedule})")
    ap.add_argument("--microbatches", type=_positive, default=microbatches, metavar="M",
                    help="micro-batches per replica"
                         + (f" (default {microbatches})" if microbatches else ""))
    ap.add_argument("--checkpoint", action="store_true", default=checkpoint,
                    help="activation checkpointing (recompute each layer's forward in "
                         "backward)")


def add_machine(ap, default: str | None = None, help_more: str = ""):
    """``--machine FILE|PRESET``: resolved by ``summasim.costmodel.machine.load_machine``."""
    ap.add_argument("--machine", default=default, metavar="FILE|PRESET",
                    help="cost-model machine: a preset name or a JSON file written by "
                         "`python -m summasim.costmodel fit`"
                         + (f" (default {default})" if default else "") + help_more)


def add_dtype(ap, choices=("float64", "float32"), default: str | None = "float64",
              help_more=""):
    """``--dtype``: the element type (``default=None``: the command picks one and
    ``help_more`` says how)."""
    ap.add_argument("--dtype", choices=choices, default=default,
                    help="element type" + (f" (default {default})" if default else "")
                         + help_more)

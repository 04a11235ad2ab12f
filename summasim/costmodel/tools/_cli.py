"""What the cost model's command-line tools (``predict``, ``plan``, ``explore``) share:
the machine, model, batch and dtype as they resolve them, output paths checked before
any work, the number format and right-aligned tables they print, and matplotlib (Agg)
for their plots. Pure: no MPI.
"""

from __future__ import annotations

import argparse
import os

from summasim import cli, options, spec
from summasim.costmodel.machine import list_presets, load_machine

#: Dtypes tried for --dtype's default, in order, among those the machine has GEMM rates for.
DEFAULT_DTYPES = ("bfloat16", "float16", "float32", "float64")
PLOT_HINT = "plots need matplotlib: pip install summasim[plot]"


def need_matplotlib(flag: str = "--plot") -> None:
    """A user error before any work when ``flag`` asks for a plot that cannot be drawn:
    the rest of the run would succeed without what was asked for."""
    if not cli.module_available("matplotlib"):
        raise cli.UsageError(f"argument {flag}: {PLOT_HINT} (or drop {flag})")

_arg = cli.argument_error


# -- arguments ------------------------------------------------------------------------------
def new_parser(parser: argparse.ArgumentParser | None, command: str,
               doc: str) -> argparse.ArgumentParser:
    """``parser`` (a sub-parser), or a new :class:`summasim.cli.ArgumentParser` for
    ``python -m summasim.costmodel COMMAND`` described by the first line of ``doc``."""
    return parser or cli.ArgumentParser(prog=f"python -m summasim.costmodel {command}",
                                        description=doc.splitlines()[0])


def add_machine(ap: argparse.ArgumentParser, default: str) -> None:
    """``--machine FILE|PRESET`` (default ``default``), its help listing the presets."""
    options.add_machine(ap, default=default,
                        help_more=f"; presets: {', '.join(list_presets())}")


def add_engine(ap: argparse.ArgumentParser) -> None:
    """How the training engine overlaps its communication (``price_composition``'s
    ``zero3_prefetch``, ``grad_overlap`` and ``p2p_overlap``)."""
    ap.add_argument("--zero3-prefetch", action="store_true",
                    help="ZeRO 3 hides each gather behind the previous piece (FSDP's "
                         "prefetch; default off, as summasim's engine runs)")
    ap.add_argument("--grad-overlap", action=argparse.BooleanOptionalAction, default=True,
                    help="the gradient reduction runs bucket by bucket under the backward "
                         "(default); --no-grad-overlap: after it, as Megatron-LM's 2019 code")
    ap.add_argument("--p2p-overlap", action="store_true",
                    help="pipeline hand-offs overlap the compute in the steady state of "
                         "1f1b or interleaved (non-blocking hand-offs, as Megatron-LM's "
                         "interleaved schedule with --overlap-p2p-communication; default: "
                         "blocking)")


def add_kernels(ap: argparse.ArgumentParser) -> None:
    """How the framework runs the memory-bound work, and the layer's norm and position
    embedding (``TransformerConfig``'s ``kernels``, ``norm`` and ``rope``)."""
    ap.add_argument("--kernels", choices=("fused", "eager"), default="fused",
                    help="fused: Megatron-LM's fused elementwise kernels (default); eager: "
                         "PyTorch eager, one kernel per operation (FSDP or torchtitan "
                         "without torch.compile; docs/costmodel.md)")
    ap.add_argument("--norm", choices=("layernorm", "rmsnorm"), default="layernorm",
                    help="the layer norms (default layernorm; Llama: rmsnorm)")
    ap.add_argument("--rope", action="store_true",
                    help="rotary position embeddings on q and k (Llama)")


def add_states(ap: argparse.ArgumentParser, bucket_default: float | None) -> None:
    """``--state-bytes P,G,O,M`` and ``--bucket-mb``, as ``plan`` and ``predict`` spell
    them (``bucket_default`` None: given or not, :data:`BUCKET_BYTES` when not)."""
    from summasim.costmodel.workload.zero import BUCKET_BYTES

    ap.add_argument("--state-bytes", type=cli.int_list(minimum=0), default=None,
                    metavar="P,G,O,M",
                    help="bytes per parameter of params, grads, each Adam moment, master "
                         "copy (default from --dtype and --grad-reduce)")
    ap.add_argument("--bucket-mb", type=cli.finite_positive_float, default=bucket_default,
                    help=f"gradient bucket in MiB (default {BUCKET_BYTES / 2**20:g}, PyTorch "
                         f"DDP's)")


def state_bytes(args, dtype, grad_reduce):
    """The :class:`StateBytes` of ``--state-bytes``, else the training's
    (:meth:`StateBytes.for_training`); a :class:`summasim.cli.UsageError` naming the flag."""
    from summasim.costmodel.workload.zero import StateBytes

    if getattr(args, "state_bytes", None) is None:
        return StateBytes.for_training(dtype, grad_reduce)
    if len(args.state_bytes) != 4:
        raise cli.argument_error("--state-bytes", f"give 4 numbers P,G,O,M, got "
                                                  f"{len(args.state_bytes)}")
    try:
        return StateBytes(*args.state_bytes)
    except ValueError as exc:
        raise cli.argument_error("--state-bytes", exc) from None


def bucket_bytes(args) -> float:
    """``--bucket-mb`` in bytes (:data:`BUCKET_BYTES` when not given)."""
    from summasim.costmodel.workload.zero import BUCKET_BYTES

    mb = getattr(args, "bucket_mb", None)
    return BUCKET_BYTES if mb is None else mb * 2**20


def kernel_fields(args) -> dict:
    """:func:`add_kernels`'s fields of a ``TransformerConfig``."""
    return {"kernels": getattr(args, "kernels", "fused"),
            "norm": getattr(args, "norm", "layernorm"), "rope": bool(getattr(args, "rope", False))}


def main(build_parser, run, argv=None) -> int:
    """A tool on its own: parse ``argv`` with ``build_parser()`` and :func:`cli.run_command`
    ``run`` (a user error is one line and status 2)."""
    ap = build_parser()
    return cli.run_command(ap.prog, run, ap.parse_args(argv))


def resolve_machine(text: str, flag: str = "--machine"):
    """:func:`~summasim.costmodel.machine.load_machine` of ``--machine FILE|PRESET``, a
    :class:`summasim.cli.UsageError` naming ``flag`` when it cannot be read."""
    try:
        return load_machine(text)
    except (OSError, ValueError) as exc:
        raise _arg(flag, exc) from None


def pick_dtype(machine, dtype: str | None) -> str:
    """``--dtype``, or the first of :data:`DEFAULT_DTYPES` the machine has GEMM rates
    for; a UsageError when the machine has none for it."""
    dtype = dtype or next((dt for dt in DEFAULT_DTYPES if dt in machine.gamma_gemm), None)
    if dtype is None or dtype not in machine.gamma_gemm:
        raise _arg("--dtype", f"machine {machine.name!r} has no GEMM rate for "
                              f"{dtype or 'any default dtype'} (it has "
                              f"{', '.join(machine.gamma_gemm)})")
    return dtype


def model_batch(args) -> tuple:
    """``(model, batch)`` of ``--model`` and ``--batch`` (default: the preset's
    published batch); UsageError when either is missing."""
    if args.model is None:
        raise _arg("--model", f"required: a preset ({', '.join(spec.MODELS)}) or "
                              f"{spec.MODEL_FORM}")
    batch = args.batch if args.batch is not None else args.model.batch
    if batch is None:
        raise _arg("--batch", f"required for model {args.model} (it has no published batch)")
    return args.model, batch


def writable(flag: str, path: str, check=cli.check_writable_path) -> str:
    """``path`` once ``check`` (a file by default, or :func:`cli.check_writable_dir`) finds
    it writable, else a UsageError naming ``flag``. A file named by ``--outdir`` (its
    default name in that folder) gets the folder made: that is what ``--outdir`` asks."""
    try:
        if flag == "--outdir" and check is cli.check_writable_path:
            cli.check_writable_dir(os.path.dirname(os.path.abspath(path)))
        return check(path)
    except cli.UsageError as exc:
        raise _arg(flag, exc) from None


# -- output ---------------------------------------------------------------------------------
def fmt(v) -> str:
    """A cell: ``-`` for None, yes/no, three significant figures (plain between 0.01
    and 10^4, trailing zeros dropped), else ``str``."""
    if isinstance(v, bool) or v is None:
        return "-" if v is None else ("yes" if v else "no")
    if isinstance(v, float):
        if v != v:
            return "nan"
        if v == 0:
            return "0"
        a = abs(v)
        return f"{v:.3g}" if (a >= 1e4 or a < 1e-2) else f"{v:.3f}".rstrip("0").rstrip(".")
    return str(v)


def table(heads: list[str], cells: list[list[str]]) -> str:
    """``heads`` over the rows of ``cells``, each column right-aligned, two spaces in."""
    width = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h)
             for i, h in enumerate(heads)]
    lines = ["  " + "  ".join(h.rjust(w) for h, w in zip(heads, width))]
    lines += ["  " + "  ".join(v.rjust(w) for v, w in zip(c, width)) for c in cells]
    return "\n".join(lines) + "\n"


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str, title: str) -> str:
    """Title ``fig``, lay it out, write it to ``path`` (its folder created) and close it."""
    plt = pyplot()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

"""Loss curves of the main job's training rows, next to the serial model's.

``python -m summasim.run --mesh ... --steps N --curves results/curves.json`` trains each
mesh for N Adam steps, validating every step against the float64 serial model (each
step from the reference's state, :mod:`summasim.harness.composed`), and writes, per mesh,
the loss the mesh computed at every step beside the serial model's loss at the same
step: a JSON report (kind ``curves``) and a plot next to it (the same name with
``.png``). The largest relative gap between the two curves is what the run's loss check
bounds step by step.
"""

from __future__ import annotations

import math
import os

from ..jsonio import write_report

KIND = "curves"


def curve_rows(reports) -> list[dict]:
    """One row per mesh report that carries a curve: its mesh, schedule, dtype, the
    losses of the mesh and of the serial model, and their largest relative gap."""
    rows = []
    for r in reports:
        par, ser = list(getattr(r, "losses", []) or []), list(getattr(r, "serial_losses", [])
                                                             or [])
        if not par or len(par) != len(ser):
            continue
        gaps = [abs(a - b) / abs(b) if b else abs(a - b) for a, b in zip(par, ser)]
        rows.append({"mesh": r.mesh, "schedule": r.schedule, "zero": r.zero,
                     "techniques": list(getattr(r, "techniques", []) or []),
                     "dtype": r.dtype, "ok": bool(r.ok), "steps": len(par),
                     "loss": par, "serial_loss": ser,
                     "max_rel_gap": max(gaps) if all(map(math.isfinite, gaps)) else None,
                     "bound": r.bound})
    return rows


def png_path(json_path: str) -> str:
    """The plot's path: the report's with ``.png`` in place of ``.json``."""
    root, ext = os.path.splitext(json_path)
    return (root if ext.lower() == ".json" else json_path) + ".png"


def write_curves(reports, json_path: str, *, title: str = "", prog: str | None = None
                 ) -> tuple[str | None, str | None]:
    """Write the curves of ``reports`` (their JSON and, when matplotlib is installed,
    the plot); returns the two paths (``None`` for one that was not written)."""
    rows = curve_rows(reports)
    if not write_report(json_path, KIND, {"title": title, "meshes": rows}, prog=prog):
        return None, None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return json_path, None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    serial_drawn = False
    for row in rows:
        steps = range(1, row["steps"] + 1)
        if not serial_drawn:
            ax.plot(steps, row["serial_loss"], color="black", lw=3, alpha=0.35,
                    label="serial model (float64)")
            serial_drawn = True
        extra = " ".join(row["techniques"])
        ax.plot(steps, row["loss"], lw=1.2, marker=".", ms=3,
                label=f"{row['mesh']} {row['schedule']} zero={row['zero']} {extra}".strip())
    ax.set_xlabel("Adam step")
    ax.set_ylabel("loss (mean cross-entropy)")
    ax.set_title(title or "loss per step: sharded training beside the serial model",
                 fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    png = png_path(json_path)
    png = os.path.realpath(png) if os.path.islink(png) else png   # a link keeps its link
    tmp = png + ".tmp.png"
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, png)
    return json_path, png

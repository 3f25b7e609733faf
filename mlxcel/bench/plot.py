"""``ttft.png``: TTFT by turn per server, and cached share by turn per server."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["PLOTS_MISSING", "plots_available", "write_plot"]

PLOTS_MISSING = "plots skipped: matplotlib is not installed (pip install 'mlxcel[bench]' for ttft.png)"


def plots_available() -> bool:
    """Whether matplotlib can be imported; asked before the run, so the user learns at once."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_plot(summary: Mapping[str, Any], path: Path, *, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, (ttft_axes, share_axes) = pyplot.subplots(1, 2, figsize=(11, 4.2))
    for name, figures in summary["servers"].items():
        rows = figures["by_turn"]
        turns = [row["turn"] for row in rows]
        ttft_axes.plot(turns, [row["ttft_median_s"] for row in rows], marker="o", label=name)
        shares = [None if row["cached_share"] is None else 100 * row["cached_share"] for row in rows]
        if any(share is not None for share in shares):
            share_axes.plot(turns, [float("nan") if s is None else s for s in shares], marker="o", label=name)
    floor = summary.get("floor") or {}
    if floor.get("warm_floor_s"):
        ttft_axes.axhline(floor["warm_floor_s"], color="grey", linestyle="--", label="in-process floor")
    ttft_axes.set(xlabel="turn", ylabel="median TTFT (s)", title="time to first token by turn")
    ttft_axes.set_ylim(bottom=0)
    share_axes.set(xlabel="turn", ylabel="cached tokens / prompt tokens (%)", title="cached share by turn")
    share_axes.set_ylim(-2, 102)
    for axes in (ttft_axes, share_axes):
        axes.grid(alpha=0.3)
        axes.legend()
        axes.xaxis.get_major_locator().set_params(integer=True)
    if title:
        figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
    return path

"""Per-server figures from request records, ratios against peers, the terminal table."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from mlxcel.bench.client import RequestRecord

__all__ = ["by_turn", "format_table", "ratios", "summarize", "summarize_server"]


def _median(values: Iterable[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


def _cached_share(records: Sequence[RequestRecord]) -> float | None:
    """Cached prompt tokens / prompt tokens, over the records that report both."""
    reported = [r for r in records if r.cached_tokens is not None and r.prompt_tokens]
    if not reported:
        return None
    return sum(r.cached_tokens or 0 for r in reported) / sum(r.prompt_tokens or 0 for r in reported)


def by_turn(records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    """Median TTFT and cached share per turn, in turn order."""
    turns = sorted({record.turn for record in records})
    rows = []
    for turn in turns:
        subset = [record for record in records if record.turn == turn]
        rows.append({
            "turn": turn,
            "ttft_median_s": _median(r.ttft_s for r in subset),
            "e2e_median_s": _median(r.e2e_s for r in subset),
            "prompt_tokens_median": _median(r.prompt_tokens for r in subset),
            "cached_share": _cached_share(subset),
        })
    return rows


def summarize_server(
    records: Sequence[RequestRecord],
    *,
    peak_rss_bytes: int | None = None,
    floor_s: float | None = None,
    cold_floor_s: float | None = None,
) -> dict[str, Any]:
    # The chat figures leave the unseen probes out; the counts take every request.
    chat = [r for r in records if not r.unseen]
    unseen = [r for r in records if r.unseen]
    cold = [r for r in chat if r.turn == 0]
    warm = [r for r in chat if r.turn >= 1]
    warm_ttft = _median(r.ttft_s for r in warm)
    unseen_ttft = _median(r.ttft_s for r in unseen)
    completion = [r.completion_tokens for r in chat if r.completion_tokens is not None]
    first = [r.ttft_s for r in chat if r.conversation == 0 and r.turn == 0]
    return {
        "num_requests": len(records),
        # The only request with nothing to reuse; the other turn-0s share the system prompt.
        "first_ttft_s": first[0] if first else None,
        "num_errors": sum(1 for r in records if r.error),
        "cold_ttft_median_s": _median(r.ttft_s for r in cold),
        "warm_ttft_median_s": warm_ttft,
        "e2e_median_s": _median(r.e2e_s for r in chat),
        "e2e_total_s": sum(r.e2e_s for r in chat),
        "warm_cached_share": _cached_share(warm),
        "reports_cached_tokens": any(r.cached_tokens is not None for r in chat),
        "completion_tokens_median": _median(completion),
        "peak_rss_mib": None if peak_rss_bytes is None else peak_rss_bytes / (1 << 20),
        "warm_over_floor": None if warm_ttft is None or not floor_s else warm_ttft / floor_s,
        # New prompts on a warmed-up server: cold TTFT without first-use compilation.
        "num_unseen": len(unseen),
        "unseen_ttft_median_s": unseen_ttft,
        "unseen_cached_share": _cached_share(unseen),
        "unseen_over_floor": None if unseen_ttft is None or not cold_floor_s else unseen_ttft / cold_floor_s,
        "by_turn": by_turn(chat),
    }


RATIO_FIELDS = {
    "first_ttft": "first_ttft_s",
    "cold_ttft": "cold_ttft_median_s",
    "warm_ttft": "warm_ttft_median_s",
    "unseen_ttft": "unseen_ttft_median_s",
    "e2e": "e2e_median_s",
    "peak_rss": "peak_rss_mib",
}


def ratios(servers: Mapping[str, Mapping[str, Any]], reference: str = "mlxcel") -> dict[str, dict[str, float | None]]:
    """``reference`` / peer for each figure in RATIO_FIELDS, per peer (below 1: the reference is better)."""
    if reference not in servers:
        return {}
    mine = servers[reference]
    result = {}
    for peer, theirs in servers.items():
        if peer == reference:
            continue
        result[peer] = {
            name: (mine[field] / theirs[field]) if mine.get(field) is not None and theirs.get(field) else None
            for name, field in RATIO_FIELDS.items()
        }
    return result


def summarize(
    records: Sequence[RequestRecord],
    *,
    peak_rss_bytes: Mapping[str, int | None] | None = None,
    floor: Mapping[str, Any] | None = None,
    reference: str = "mlxcel",
) -> dict[str, Any]:
    names = list(dict.fromkeys(record.server for record in records))
    floor_s = None if floor is None else floor.get("warm_floor_s")
    cold_floor_s = None if floor is None else floor.get("cold_floor_s")
    servers = {
        name: summarize_server(
            [r for r in records if r.server == name],
            peak_rss_bytes=(peak_rss_bytes or {}).get(name),
            floor_s=floor_s,
            cold_floor_s=cold_floor_s,
        )
        for name in names
    }
    return {"servers": servers, "ratios": ratios(servers, reference), "floor": dict(floor) if floor else None}


def _cell(value: Any, kind: str | None) -> str:
    if value is None:
        return "-"
    if kind == "s":
        return f"{value:.3f} s"
    if kind == "%":
        return f"{100 * value:.1f}%"
    if kind == "MiB":
        return f"{value:,.0f} MiB"
    if kind == "x":
        return f"{value:.2f}x"
    return str(value)


def format_table(summary: Mapping[str, Any]) -> str:
    columns = [
        ("server", None, None),
        ("1st TTFT", "first_ttft_s", "s"),
        ("cold TTFT", "cold_ttft_median_s", "s"),
        ("warm TTFT", "warm_ttft_median_s", "s"),
        ("warm/floor", "warm_over_floor", "x"),
        ("unseen TTFT", "unseen_ttft_median_s", "s"),
        ("unseen/floor", "unseen_over_floor", "x"),
        ("e2e median", "e2e_median_s", "s"),
        ("warm cached", "warm_cached_share", "%"),
        ("peak RSS", "peak_rss_mib", "MiB"),
        ("errors", "num_errors", None),
    ]
    rows = [[header for header, _, _ in columns]]
    for name, figures in summary["servers"].items():
        rows.append([name] + [_cell(figures.get(field), kind) for _, field, kind in columns[1:] if field])
    for peer, values in summary.get("ratios", {}).items():
        rows.append([f"mlxcel / {peer}", _cell(values["first_ttft"], "x"), _cell(values["cold_ttft"], "x"),
                     _cell(values["warm_ttft"], "x"), "", _cell(values["unseen_ttft"], "x"), "",
                     _cell(values["e2e"], "x"), "", _cell(values["peak_rss"], "x"), ""])
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = [
        "  ".join(
            cell.ljust(width) if i == 0 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=False))
        )
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    floor = summary.get("floor")
    if floor and floor.get("warm_floor_s") is not None:
        lines.append(
            f"in-process floor (prefill the ~{floor.get('suffix_tokens_median')}-token uncached suffix in one chunk, "
            f"first token): {floor['warm_floor_s']:.3f} s"
            + (f"; cold, the {floor['cold_prompt_tokens']}-token first prompt in chunks of "
               f"{floor.get('prefill_step_size')}: {floor['cold_floor_s']:.3f} s"
               if floor.get("cold_floor_s") is not None else "")
        )
    lines.append("1st = the very first request (nothing cached); TTFT medians: cold = turn 0 (from the 2nd "
                 "conversation on, the system prompt can be reused), warm = turns >= 1 (/floor: over the warm "
                 "floor), unseen = new prompts sent after the chat turns, nothing to reuse (/floor: over the cold "
                 "floor); cached = cached_tokens / prompt_tokens on warm turns ('-': the server reports none).")
    return "\n".join(lines)

"""Summaries, ratios, the terminal table and the PNG, from synthetic records; CLI flag errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlxcel.bench.cli import bench_main
from mlxcel.bench.client import RequestRecord, parse_sse_lines
from mlxcel.bench.plot import write_plot
from mlxcel.bench.summary import format_table, summarize


def record(server: str, conversation: int, turn: int, ttft: float, prompt: int, cached: int | None) -> RequestRecord:
    return RequestRecord(server=server, conversation=conversation, turn=turn, ttft_s=ttft, e2e_s=ttft + 0.5,
                         prompt_tokens=prompt, cached_tokens=cached, completion_tokens=16)


def synthetic() -> list[RequestRecord]:
    records = []
    for conversation in range(2):
        records.append(record("mlxcel", conversation, 0, 2.0 + conversation, 1000, 0))
        records.append(record("mlxcel", conversation, 1, 0.2, 1200, 1000))
        records.append(record("peer", conversation, 0, 4.0, 1000, None))
        records.append(record("peer", conversation, 1, 0.8, 1200, None))
    return records


def test_summary_figures_and_ratios() -> None:
    summary = summarize(synthetic(), peak_rss_bytes={"mlxcel": 400 << 20, "peer": 800 << 20},
                        floor={"warm_floor_s": 0.1, "suffix_tokens_median": 140})
    mine, theirs = summary["servers"]["mlxcel"], summary["servers"]["peer"]
    assert mine["first_ttft_s"] == pytest.approx(2.0)
    assert mine["cold_ttft_median_s"] == pytest.approx(2.5)
    assert mine["warm_ttft_median_s"] == pytest.approx(0.2)
    assert mine["warm_cached_share"] == pytest.approx(1000 / 1200)
    assert mine["warm_over_floor"] == pytest.approx(2.0)
    assert mine["peak_rss_mib"] == pytest.approx(400)
    assert theirs["warm_cached_share"] is None and theirs["reports_cached_tokens"] is False
    assert [row["turn"] for row in mine["by_turn"]] == [0, 1]
    assert mine["by_turn"][0]["cached_share"] == 0.0
    ratios = summary["ratios"]["peer"]
    assert ratios["cold_ttft"] == pytest.approx(2.5 / 4.0)
    assert ratios["warm_ttft"] == pytest.approx(0.25)
    assert ratios["peak_rss"] == pytest.approx(0.5)
    table = format_table(summary)
    assert "mlxcel / peer" in table and "0.25x" in table and "83.3%" in table
    json.dumps(summary)


def test_plot_is_a_png(tmp_path: Path) -> None:
    summary = summarize(synthetic(), floor={"warm_floor_s": 0.1})
    path = write_plot(summary, tmp_path / "ttft.png", title="synthetic")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sse_parsing_stops_at_done() -> None:
    lines = [": comment", "", 'data: {"a": 1}', "event: x", "data: [DONE]", 'data: {"b": 2}']
    assert list(parse_sse_lines(lines)) == [{"a": 1}]


@pytest.mark.parametrize("argv", [
    ["--bogus"],
    ["--compare"],
    ["--url", "http://127.0.0.1:1", "--compare", "--model-path", "."],
    ["--url", "127.0.0.1:8080"],
    ["--url", "http://127.0.0.1:1", "--concurrency", "3"],
    ["--url", "http://127.0.0.1:1", "--turns", "0"],
    ["--compare", "--model-path", "/nonexistent-folder"],
])
def test_bad_flags_one_line_and_status_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("mlxcel bench: error:") and err.count("\n") == 1

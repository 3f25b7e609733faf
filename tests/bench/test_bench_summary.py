"""Summaries, ratios, the terminal table and the PNG, from synthetic records; CLI flag errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlxcel.bench import floor as floor_module
from mlxcel.bench.cli import bench_main
from mlxcel.bench.client import RequestRecord, format_progress, parse_sse_lines
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
    assert theirs["warm_cached_share"] is None
    assert theirs["reports_cached_tokens"] is False
    assert [row["turn"] for row in mine["by_turn"]] == [0, 1]
    assert mine["by_turn"][0]["cached_share"] == 0.0
    ratios = summary["ratios"]["peer"]
    assert ratios["cold_ttft"] == pytest.approx(2.5 / 4.0)
    assert ratios["warm_ttft"] == pytest.approx(0.25)
    assert ratios["peak_rss"] == pytest.approx(0.5)
    table = format_table(summary)
    assert "mlxcel / peer" in table
    assert "0.25x" in table
    assert "83.3%" in table
    json.dumps(summary)


def unseen(server: str, index: int, ttft: float, cached: int | None, error: str | None = None) -> RequestRecord:
    return RequestRecord(server=server, conversation=index, turn=0, ttft_s=ttft, e2e_s=ttft + 0.5,
                         prompt_tokens=1000 + 8 * index, cached_tokens=cached, completion_tokens=16, error=error,
                         unseen=True)


def test_unseen_probes_stay_out_of_the_chat_figures() -> None:
    floor = {"warm_floor_s": 0.1, "cold_floor_s": 0.5, "suffix_tokens_median": 140, "cold_prompt_tokens": 1040,
             "prefill_step_size": 256}
    probes = [unseen("mlxcel", 0, 1.0, 0), unseen("mlxcel", 1, 1.2, 0), unseen("mlxcel", 2, 1.4, 0),
              unseen("peer", 0, 2.0, None), unseen("peer", 1, 2.4, None, error="HTTP 500"),
              unseen("peer", 2, 2.8, None)]
    without = summarize(synthetic(), floor=floor)
    summary = summarize(synthetic() + probes, floor=floor)
    mine, theirs = summary["servers"]["mlxcel"], summary["servers"]["peer"]
    chat_fields = ["first_ttft_s", "cold_ttft_median_s", "warm_ttft_median_s", "e2e_median_s", "e2e_total_s",
                   "warm_cached_share", "warm_over_floor", "completion_tokens_median", "by_turn"]
    for name in ("mlxcel", "peer"):
        for field in chat_fields:
            assert summary["servers"][name][field] == without["servers"][name][field], (name, field)
    assert [row["turn"] for row in mine["by_turn"]] == [0, 1]
    assert mine["by_turn"][0]["ttft_median_s"] == pytest.approx(2.5)
    assert mine["num_requests"] == 7
    assert mine["num_unseen"] == 3
    assert mine["num_errors"] == 0
    assert theirs["num_errors"] == 1
    assert mine["unseen_ttft_median_s"] == pytest.approx(1.2)
    assert mine["unseen_cached_share"] == 0.0
    assert theirs["unseen_cached_share"] is None
    assert mine["unseen_over_floor"] == pytest.approx(1.2 / 0.5)
    assert summary["ratios"]["peer"]["unseen_ttft"] == pytest.approx(0.5)
    table = format_table(summary)
    assert "unseen TTFT" in table
    assert "unseen/floor" in table
    assert "2.40x" in table
    assert "chunks of 256" in table
    ratio_row = next(line for line in table.splitlines() if line.startswith("mlxcel / peer"))
    assert "0.50x" in ratio_row
    # No probes, or no cold floor: no unseen figures.
    assert without["servers"]["mlxcel"]["unseen_ttft_median_s"] is None
    assert without["servers"]["mlxcel"]["unseen_over_floor"] is None
    assert without["ratios"]["peer"]["unseen_ttft"] is None
    assert summarize(probes, floor={"warm_floor_s": 0.1})["servers"]["mlxcel"]["unseen_over_floor"] is None


def test_unseen_records_are_marked_in_json_and_progress() -> None:
    probe = unseen("mlxcel", 1, 1.0, 0)
    assert probe.to_json()["unseen"] is True
    assert "reply" not in probe.to_json()
    assert record("mlxcel", 0, 0, 1.0, 10, 0).to_json()["unseen"] is False
    assert "] unseen  1: ttft" in format_progress(probe)
    assert "conversation  0 turn 0" in format_progress(record("mlxcel", 0, 0, 1.0, 10, 0))


def test_floor_step_follows_the_server_default(monkeypatch: pytest.MonkeyPatch) -> None:
    import mlx.core as mx

    from mlxcel.model.loader import default_prefill_step_size

    assert floor_module.build_parser().parse_args(["--model-path", "m"]).prefill_step_size is None
    assert default_prefill_step_size() == (256 if mx.default_device() == mx.cpu else 2048)
    commands = []

    class Completed:
        returncode, stdout, stderr = 0, '{"cold_floor_s": 1.0}\n', ""

    monkeypatch.setattr(floor_module.subprocess, "run", lambda command, **_: commands.append(command) or Completed())
    assert floor_module.measure_floor("m", floor_module.Shape()) == {"cold_floor_s": 1.0}
    floor_module.measure_floor("m", floor_module.Shape(), prefill_step_size=512)
    assert "--prefill-step-size" not in commands[0]
    assert commands[1][-2:] == ["--prefill-step-size", "512"]


@pytest.mark.slow
def test_plot_is_a_png(tmp_path: Path) -> None:
    summary = summarize(synthetic() + [unseen("mlxcel", 0, 1.0, 0)], floor={"warm_floor_s": 0.1})
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
    ["--url", "http://127.0.0.1:1", "--unseen", "-1"],
    ["--url", "http://127.0.0.1:1", "--unseen", "some"],
    ["--compare", "--model-path", "/nonexistent-folder"],
])
def test_bad_flags_one_line_and_status_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("mlxcel bench: error:")
    assert err.count("\n") == 1

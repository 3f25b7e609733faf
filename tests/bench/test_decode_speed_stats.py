"""The decode benchmark's statistics: per-token gaps, percentiles, ratios, stream parsing and the table."""

from __future__ import annotations

import json

import pytest

from benchmarks.decode_speed import (
    StreamResult,
    all_active_rate,
    combine_floors,
    format_table,
    largest_gaps,
    median_gap,
    parse_stream,
    percentile,
    ratio,
    stream_gaps,
    table_rows,
)


def test_median_gap_pools_every_streams_gaps() -> None:
    # Stream a: gaps 1, 1, 1; stream b: gaps 5, 5. Pooled [1, 1, 1, 5, 5]: median 1, not the mean of medians (3).
    streams = [[0.0, 1.0, 2.0, 3.0], [10.0, 15.0, 20.0]]
    assert stream_gaps(streams[1]) == [5.0, 5.0]
    assert median_gap(streams) == 1.0
    # The gap between two streams' tokens is never counted.
    assert median_gap([[0.0, 0.5], [100.0, 100.5]]) == 0.5


def test_largest_gaps_name_the_token_they_delayed_and_when() -> None:
    # Sent at 10.0; stream a waits 3 s before its third token, stream b 2 s before its second.
    streams = [[11.0, 11.5, 14.5, 15.0], [12.0, 14.0]]
    assert largest_gaps(streams, opened=10.0, count=2) == [
        {"gap_s": 3.0, "token": 2, "at_s": 4.5},
        {"gap_s": 2.0, "token": 1, "at_s": 4.0},
    ]
    assert len(largest_gaps(streams, opened=10.0)) == 4  # all there are, when fewer than count
    assert largest_gaps([[1.0]], opened=0.0) == []


def test_median_gap_without_two_tokens_in_any_stream() -> None:
    assert median_gap([]) is None
    assert median_gap([[1.0], []]) is None


def test_percentile_interpolates_between_ranks() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.99) == pytest.approx(99.01)
    assert percentile(values, 0.5) == pytest.approx(50.5)
    assert percentile([3.0, 1.0, 2.0], 1.0) == 3.0
    assert percentile([3.0, 1.0, 2.0], 0.0) == 1.0
    assert percentile([7.0], 0.99) == 7.0
    assert percentile([], 0.99) is None
    with pytest.raises(ValueError):
        percentile([1.0], 99)


def test_ratio_to_the_floor() -> None:
    assert ratio(0.0117, 0.0064) == pytest.approx(1.828, abs=1e-3)
    assert ratio(None, 1.0) is None
    assert ratio(1.0, None) is None
    assert ratio(1.0, 0.0) is None


def test_all_active_rate_counts_only_the_window_where_every_stream_decodes() -> None:
    # a decodes 0..10 at 1 token/s; b starts at 5 and ends at 8 (4 tokens/s there).
    a = [float(t) for t in range(0, 11)]
    b = [5.0, 5.25, 5.5, 5.75, 6.0, 6.25, 6.5, 6.75, 7.0, 7.25, 7.5, 7.75, 8.0]
    # Window (5, 8]: a has 6, 7, 8 and b has 12 tokens after 5.0: 15 tokens in 3 s.
    assert all_active_rate([a, b]) == pytest.approx(5.0)
    assert all_active_rate([[0.0, 1.0], [2.0, 3.0]]) is None  # never both at once
    assert all_active_rate([]) is None


def test_combine_floors_takes_each_batchs_fastest_run() -> None:
    before = {"device": "cpu", "batches": [{"batch": 1, "step_ms": 10.0}, {"batch": 16, "step_ms": 30.0}]}
    after = {"device": "cpu", "batches": [{"batch": 1, "step_ms": 12.0}, {"batch": 16, "step_ms": 25.0}]}
    combined = combine_floors([before, after])
    assert [row["step_ms"] for row in combined["batches"]] == [10.0, 25.0]
    assert combined["runs"] == [before["batches"], after["batches"]]
    assert combined["device"] == "cpu"


def _event(body: object) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _content(text: str, finish: str | None = None) -> dict[str, object]:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}


def test_parse_stream_times_each_token_by_the_chunk_that_completes_its_event() -> None:
    second = _event(_content("b"))
    chunks = [
        (1.0, _event({"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})),
        (1.5, _event(_content("a")) + second[:7]),  # an event split across two reads
        (2.0, second[7:]),
        (2.5, _event(_content("c", "length"))),
        (2.6, _event({"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 40,
                                               "prompt_tokens_details": {"cached_tokens": 32}}}) + b"data: [DONE]\n\n"),
    ]
    result = parse_stream(0.5, 2.7, chunks, None)
    assert result.token_times == [1.5, 2.0, 2.5]
    assert result.text == "abc"
    assert result.ttft == pytest.approx(1.0)
    assert (result.completion_tokens, result.prompt_tokens, result.cached_tokens) == (3, 40, 32)
    assert result.served
    assert result.problem(3) is None
    assert result.problem(4) == "short: 3/4 tokens, finish length"


def test_unserved_and_stopped_streams_are_problems() -> None:
    no_done = parse_stream(0.0, 1.0, [(0.5, _event(_content("a", "length")))], None)
    assert not no_done.served
    assert no_done.problem(None) == "no [DONE]"
    failed = parse_stream(0.0, 1.0, [], "HTTP 503: busy")
    assert failed.problem(None) == "HTTP 503: busy"
    error_event = parse_stream(0.0, 1.0, [(0.5, _event({"error": {"message": "boom"}}) + b"data: [DONE]\n\n")], None)
    assert error_event.problem(None).startswith("error event")
    stopped = parse_stream(0.0, 1.0, [(0.5, _event(_content("a", "stop")) + b"data: [DONE]\n\n")], None)
    assert stopped.problem(None) is None
    assert stopped.problem(1) == "short: 1/1 tokens, finish stop"


def _report() -> dict[str, object]:
    streams = {"1": {"per_token_interval_s": 0.0117, "aggregate_tokens_per_s": 80.0, "all_active_tokens_per_s": 85.0,
                     "problems": []}}
    return {
        "config": {"streams": [1], "skip_streams": False, "skip_wave": False, "skip_conversations": True, "wave": 8},
        "floor": {"batches": [{"batch": 1, "step_ms": 6.4, "tokens_per_s": 156.25}]},
        "servers": {
            "mlxcel": {"streams": streams, "wave": {"ttft_median_s": 0.2, "ttft_p99_s": 0.4, "problems": []}},
            "mlx_lm": {"streams": {"1": {**streams["1"], "problems": ["short: 200/256 tokens, finish stop"]}},
                       "wave": {"ttft_median_s": 0.5, "ttft_p99_s": None, "problems": ["HTTP 503: busy"]}},
        },
    }


def test_table_rows_put_each_server_figure_over_the_floor() -> None:
    report = _report()
    rows = {row["figure"]: row for row in table_rows(report)}
    interval = rows["1 stream: per-token interval"]
    assert interval["floor"] == pytest.approx(0.0064)
    assert interval["ratios"]["mlxcel"] == pytest.approx(0.0117 / 0.0064)
    assert rows["1 stream: aggregate tokens/s"]["ratios"]["mlxcel"] == pytest.approx(80.0 / 156.25)
    assert rows["8 short requests at once: TTFT median"]["ratios"] == {"mlxcel": None, "mlx_lm": None}
    report["table"] = list(rows.values())
    text = format_table(report)
    assert "| 1 stream: per-token interval | 6.40 ms | 11.70 ms | 1.83x | 11.70 ms | 1.83x |" in text
    assert "mlxcel: every stream served" in text
    assert "mlx_lm: 2 streams failed or short" in text
    assert "wave: HTTP 503: busy" in text


def test_stream_result_round_trips_through_a_dict() -> None:
    # The client processes send their results back as dicts.
    from dataclasses import asdict

    result = StreamResult(sent=1.0, end=2.0, token_times=[1.5], text="a", finish_reason="length", done=True)
    assert StreamResult(**asdict(result)) == result


@pytest.mark.slow
async def test_stream_client_times_every_token_of_real_streams(start_engine, start_server) -> None:
    # The decode benchmark's client against mlxcel over HTTP: one process and two (the results in body order).
    import trio

    from benchmarks.decode_speed import StreamClient, _body

    engine = await start_engine()
    base_url = await start_server(engine)
    bodies = [_body("llama-v1-seed0", [{"role": "user", "content": "word " * (4 + 3 * index)}], 6)
              for index in range(3)]

    def run(processes: int) -> list[StreamResult]:
        client = StreamClient(base_url, processes=processes, timeout_s=60, stop_at=float("inf"))
        try:
            return client.round(bodies)[0]
        finally:
            client.close()

    for processes in (1, 2):
        results = await trio.to_thread.run_sync(run, processes)
        prompt_lengths = [result.prompt_tokens for result in results]
        assert all(length is not None for length in prompt_lengths)
        assert prompt_lengths == sorted(prompt_lengths)
        assert len(set(prompt_lengths)) == 3
        for result in results:
            assert result.problem(6) is None
            assert len(result.token_times) == result.completion_tokens == 6
            assert result.sent < result.token_times[0] <= result.token_times[-1] <= result.end
        assert median_gap([result.token_times for result in results]) > 0
    # The engine goes idle before the test stops it: stopped straight after the last stream's end, the
    # process aborted at exit in 3 of 5 runs ("terminate called without an active exception"), 0 of 3 so.
    await trio.sleep(3)


def test_token_timeline_groups_the_streams_tokens_into_one_burst_a_step() -> None:
    from benchmarks.token_timeline import bursts

    # Two streams, steps at 0, 10 and 30 ms: each stream's token of a step lands within a fraction of a ms.
    times = [0.0, 0.0002, 0.010, 0.0101, 0.030, 0.0304]
    assert bursts(times, burst_gap_s=0.001) == [(0.0, 2), (0.010, 2), (0.030, 2)]
    # A pause shorter than the burst gap keeps tokens in one burst.
    assert bursts([0.0, 0.0009, 0.0018], burst_gap_s=0.001) == [(0.0, 3)]

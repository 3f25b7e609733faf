"""`mlxcel bench` without matplotlib (a plain `pip install mlxcel`): it says so at once and still finishes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import trio

from mlxcel.bench import cli
from mlxcel.bench.plot import PLOTS_MISSING


@pytest.mark.slow
async def test_bench_without_matplotlib_skips_the_plot_with_one_line_up_front(
    start_engine, start_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    # None in sys.modules makes `import matplotlib` raise ImportError, as when it is not installed.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    engine = await start_engine()
    base_url = await start_server(engine)
    out = tmp_path / "results"
    namespace = cli.build_parser().parse_args([
        "--url", base_url, "--conversations", "1", "--turns", "1", "--system-tokens", "20",
        "--user-tokens", "5", "--reply-tokens", "2", "--unseen", "0", "--out", str(out),
    ])
    status = await trio.to_thread.run_sync(cli._run, namespace, None, "test BLAS")

    captured = capsys.readouterr()
    assert status == 0
    lines = captured.err.splitlines()
    assert lines.count(PLOTS_MISSING) == 1
    # Before the benchmark's own first line, not after the run.
    assert lines.index(PLOTS_MISSING) < next(i for i, line in enumerate(lines) if line.startswith("mlxcel bench:"))
    assert (out / "summary.json").is_file()
    assert (out / "requests.jsonl").is_file()
    assert not (out / "ttft.png").exists()
    assert "ttft.png" not in captured.out


def test_bench_extra_and_test_extra_both_carry_matplotlib() -> None:
    import tomllib

    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(requirement.startswith("matplotlib") for requirement in extras["bench"])
    assert any(requirement.startswith("matplotlib") for requirement in extras["test"])
    assert not any("matplotlib" in requirement for requirement in
                   tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["dependencies"])

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest

from mlxcel import blas

DEBIAN = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
PTHREAD = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
CANDIDATES = (DEBIAN, PTHREAD)


def exists_only(*paths: str):
    return lambda path: path in paths


def test_finds_first_existing_candidate() -> None:
    found = blas.find_optimized_blas({}, platform="linux", candidates=CANDIDATES, exists=exists_only(DEBIAN, PTHREAD))
    assert found == DEBIAN


def test_falls_back_to_later_candidate() -> None:
    found = blas.find_optimized_blas({}, platform="linux", candidates=CANDIDATES, exists=exists_only(PTHREAD))
    assert found == PTHREAD


def test_none_when_nothing_installed() -> None:
    assert blas.find_optimized_blas({}, platform="linux", candidates=CANDIDATES, exists=exists_only()) is None


@pytest.mark.parametrize("platform", ["darwin", "win32"])
def test_only_on_linux(platform: str) -> None:
    assert blas.find_optimized_blas({}, platform=platform, candidates=CANDIDATES, exists=exists_only(DEBIAN)) is None


@pytest.mark.parametrize("value", ["reference", "REFERENCE", "off", " bundled "])
def test_env_disables(value: str) -> None:
    environ = {blas.BLAS_ENV: value}
    assert blas.find_optimized_blas(environ, platform="linux", candidates=CANDIDATES, exists=exists_only(DEBIAN)) is None


@pytest.mark.parametrize("value", ["", "auto"])
def test_env_auto_searches(value: str) -> None:
    environ = {blas.BLAS_ENV: value}
    assert blas.find_optimized_blas(environ, platform="linux", candidates=CANDIDATES, exists=exists_only(DEBIAN)) == DEBIAN


def test_env_forces_a_path() -> None:
    forced = "/opt/blis/libblis.so.4"
    environ = {blas.BLAS_ENV: forced}
    found = blas.find_optimized_blas(environ, platform="linux", candidates=CANDIDATES, exists=exists_only(DEBIAN, forced))
    assert found == forced


def test_env_forced_path_that_does_not_exist() -> None:
    environ = {blas.BLAS_ENV: "/missing/lib.so"}
    assert blas.find_optimized_blas(environ, platform="linux", candidates=CANDIDATES, exists=exists_only(DEBIAN)) is None


def preload(environ: dict[str, str], *, platform: str = "linux", installed: tuple[str, ...] = (DEBIAN,)):
    return blas.preload_environment(environ, platform=platform, candidates=CANDIDATES, exists=exists_only(*installed))


def test_preload_environment_prepends_and_marks() -> None:
    environment = preload({"PATH": "/bin", "LD_PRELOAD": "/lib/libfoo.so"})
    assert environment == {
        "PATH": "/bin",
        "LD_PRELOAD": f"{DEBIAN}:/lib/libfoo.so",
        blas.REEXEC_MARKER_ENV: "1",
    }


def test_preload_environment_without_existing_preload() -> None:
    environment = preload({"PATH": "/bin"})
    assert environment is not None
    assert environment["LD_PRELOAD"] == DEBIAN


def test_preload_environment_does_not_mutate_input() -> None:
    environ = {"PATH": "/bin"}
    preload(environ)
    assert environ == {"PATH": "/bin"}


@pytest.mark.parametrize("existing", [DEBIAN, f"/lib/a.so:{DEBIAN}", f"/lib/a.so {DEBIAN}"])
def test_preload_environment_none_when_already_preloaded(existing: str) -> None:
    assert preload({"LD_PRELOAD": existing}) is None


def test_preload_environment_none_after_a_reexec() -> None:
    assert preload({blas.REEXEC_MARKER_ENV: "1"}) is None


def test_preload_environment_none_when_unavailable() -> None:
    assert preload({}, installed=()) is None
    assert preload({}, platform="darwin") is None
    assert preload({blas.BLAS_ENV: "reference"}) is None


def test_reexec_calls_execve(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(blas, "preload_environment", lambda: {"LD_PRELOAD": DEBIAN, blas.REEXEC_MARKER_ENV: "1"})
    monkeypatch.setattr(os, "execve", lambda *arguments: calls.append(arguments))
    blas.reexec_with_optimized_blas(["-m", "mlxcel", "serve"])
    assert calls == [
        (sys.executable, [sys.executable, "-m", "mlxcel", "serve"], {"LD_PRELOAD": DEBIAN, blas.REEXEC_MARKER_ENV: "1"})
    ]


def test_reexec_does_nothing_without_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blas, "preload_environment", lambda: None)
    monkeypatch.setattr(os, "execve", lambda *arguments: pytest.fail("must not exec"))
    blas.reexec_with_optimized_blas(["x"])


REFERENCE_MAPS = (
    "7f0000000000-7f0000001000 r-xp 00000000 08:01 123 "
    "/venv/lib/python3.11/site-packages/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0\n"
    "7f0000002000-7f0000003000 r--p 00000000 00:00 0 \n"
)
OPENBLAS_MAPS = REFERENCE_MAPS + (
    "7f0000004000-7f0000005000 r-xp 00000000 08:01 456 "
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblasp-r0.3.21.so\n"
)


def test_describe_reference() -> None:
    line = blas.describe_blas({}, maps=REFERENCE_MAPS, platform="linux")
    assert line == "BLAS: reference BLAS bundled with mlx (slow; install libopenblas0)"


def test_describe_preloaded() -> None:
    line = blas.describe_blas({"LD_PRELOAD": DEBIAN}, maps=OPENBLAS_MAPS, platform="linux")
    assert line == f"BLAS: OpenBLAS preloaded from {DEBIAN}"


def test_describe_loaded_in_process() -> None:
    line = blas.describe_blas({}, maps=OPENBLAS_MAPS, platform="linux")
    assert line == "BLAS: OpenBLAS loaded from /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblasp-r0.3.21.so"


def test_describe_ignores_unrelated_preloads() -> None:
    line = blas.describe_blas({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, maps=REFERENCE_MAPS, platform="linux")
    assert line.startswith("BLAS: reference BLAS")


def test_describe_macos() -> None:
    assert blas.describe_blas({}, maps="", platform="darwin") == "BLAS: Accelerate (macOS)"


def test_in_process_load_refuses_after_mlx_is_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mlx.core", object())
    assert blas.load_optimized_blas_in_process({}, platform="linux", maps=OPENBLAS_MAPS) is None


def test_a_load_too_late_warns_when_mlx_runs_on_the_reference_blas(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    """A benchmark that imported MLX first measured every CPU pass on the reference BLAS, silently
    (a width-5 verify pass 4.9x a width-1 one instead of 1.9x: docs/benchmarks.md)."""
    library = tmp_path / "libopenblas.so.0"
    library.write_bytes(b"")
    monkeypatch.setitem(sys.modules, "mlx.core", object())
    environ = {blas.BLAS_ENV: str(library)}
    with pytest.warns(RuntimeWarning, match="reference BLAS"):
        assert blas.load_optimized_blas_in_process(environ, platform="linux", maps=REFERENCE_MAPS) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert blas.load_optimized_blas_in_process(environ, platform="linux", maps=OPENBLAS_MAPS) is None
        assert blas.load_optimized_blas_in_process({blas.BLAS_ENV: "reference"}, platform="linux",
                                                   maps=REFERENCE_MAPS) is None


def test_importing_the_package_and_its_blas_module_loads_no_mlx() -> None:
    """The suite and the benchmarks bind MLX to OpenBLAS after ``import mlxcel.blas``; were MLX loaded by
    then, they would run on the reference BLAS (~40x slower), as the suite did for a while."""
    import subprocess
    import sys

    code = "import sys, mlxcel, mlxcel.blas; print('mlx.core' in sys.modules, mlxcel.ChatRequest.__name__)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "ChatRequest"]


def test_this_test_process_runs_mlx_on_the_optimized_blas_where_the_machine_has_one() -> None:
    """conftest.py preloads it; a regression there makes every model test slow, not red."""
    import sys

    if sys.platform == "darwin" or blas.find_optimized_blas(platform=sys.platform) is None:
        pytest.skip("no optimized BLAS on this machine")
    assert not blas.describe_blas().startswith("BLAS: reference"), blas.describe_blas()

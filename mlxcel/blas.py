"""Choosing a fast BLAS for MLX's CPU backend on Linux.

The ``mlx[cpu]`` Linux wheel bundles the reference BLAS, about 3 GFLOP/s on a
float32 1024x1024 matmul, against about 100 GFLOP/s for Debian's OpenBLAS on
the same two cores. The bundled library is a load-time dependency of MLX, so
the fast one has to win symbol lookup before MLX loads: either preloaded by
the dynamic linker (the CLI re-executes itself with ``LD_PRELOAD``), or, for
a process that cannot re-exec such as a test run, opened with
``RTLD_GLOBAL`` before ``mlx.core`` is first imported.

``MLXCEL_BLAS=reference`` keeps the bundled library; ``MLXCEL_BLAS=/path/lib.so``
picks a library. Pure standard library: importing this never loads MLX.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence

__all__ = [
    "BLAS_ENV",
    "OPTIMIZED_BLAS_CANDIDATES",
    "REEXEC_MARKER_ENV",
    "describe_blas",
    "find_optimized_blas",
    "load_optimized_blas_in_process",
    "preload_environment",
    "reexec_with_optimized_blas",
]

BLAS_ENV = "MLXCEL_BLAS"
# Set in the re-executed process so a failed preload cannot loop.
REEXEC_MARKER_ENV = "MLXCEL_BLAS_REEXEC"

# Debian and Ubuntu's libopenblas0 (the alternatives link, then the pthread build).
OPTIMIZED_BLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
)

_REFERENCE_VALUES = frozenset({"reference", "bundled", "off", "none"})
_AUTO_VALUES = frozenset({"", "auto"})
_OPTIMIZED_LIBRARY = re.compile(r"lib(openblas|mkl_rt|blis)[\w.-]*\.so[\w.]*$")
_BUNDLED_LIBRARY = re.compile(r"mlx_cpu\.libs/libblas[\w.-]*\.so")


def find_optimized_blas(
    environ: Mapping[str, str] | None = None,
    *,
    platform: str | None = None,
    candidates: Sequence[str] = OPTIMIZED_BLAS_CANDIDATES,
    exists: Callable[[str], bool] = os.path.exists,
) -> str | None:
    """The optimized BLAS library to use, or None (not Linux, disabled, none found)."""
    environ = os.environ if environ is None else environ
    platform = sys.platform if platform is None else platform
    if not platform.startswith("linux"):
        return None
    choice = environ.get(BLAS_ENV, "").strip()
    if choice.lower() in _REFERENCE_VALUES:
        return None
    if choice.lower() not in _AUTO_VALUES:
        return choice if exists(choice) else None
    return next((path for path in candidates if exists(path)), None)


def _preloaded(environ: Mapping[str, str]) -> list[str]:
    # ld.so accepts both spaces and colons between LD_PRELOAD entries.
    return [entry for entry in re.split(r"[:\s]+", environ.get("LD_PRELOAD", "")) if entry]


def preload_environment(
    environ: Mapping[str, str] | None = None,
    *,
    platform: str | None = None,
    candidates: Sequence[str] = OPTIMIZED_BLAS_CANDIDATES,
    exists: Callable[[str], bool] = os.path.exists,
) -> dict[str, str] | None:
    """The environment to re-exec with, or None when a re-exec would not help."""
    environ = os.environ if environ is None else environ
    if environ.get(REEXEC_MARKER_ENV):
        return None
    library = find_optimized_blas(environ, platform=platform, candidates=candidates, exists=exists)
    if library is None:
        return None
    preloaded = _preloaded(environ)
    if library in preloaded:
        return None
    environment = dict(environ)
    environment["LD_PRELOAD"] = ":".join([library, *preloaded])
    environment[REEXEC_MARKER_ENV] = "1"
    return environment


def reexec_with_optimized_blas(argv: Sequence[str] | None = None) -> None:
    """Replace this process with one that preloads the optimized BLAS, if useful.

    ``argv`` is what follows the interpreter (default ``sys.orig_argv[1:]``, so
    ``python -m mlxcel ...`` re-runs as itself). Returns only when no re-exec
    is needed. Call it before anything imports MLX.
    """
    environment = preload_environment()
    if environment is None:
        return
    arguments = list(sys.orig_argv[1:] if argv is None else argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *arguments], environment)


def load_optimized_blas_in_process(
    environ: Mapping[str, str] | None = None,
    *,
    platform: str | None = None,
    maps: str | None = None,
) -> str | None:
    """Open the optimized BLAS globally so MLX, imported later, binds to it.

    For processes that cannot re-exec (a test run). Returns the library
    opened, or None when there is none or MLX is already loaded (too late:
    then a warning, where a library was there to load, since every CPU
    figure the process measures is the reference BLAS's).
    """
    if "mlx.core" in sys.modules:
        if (find_optimized_blas(environ, platform=platform) is not None
                and describe_blas(environ, maps=maps, platform=platform).startswith("BLAS: reference")):
            warnings.warn("mlx.core was imported before the optimized BLAS could be loaded: MLX's CPU backend "
                          "runs on the bundled reference BLAS in this process", RuntimeWarning, stacklevel=2)
        return None
    library = find_optimized_blas(environ, platform=platform)
    if library is None:
        return None
    try:
        ctypes.CDLL(library, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
    except OSError:
        return None
    return library


def _read_maps() -> str:
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            return maps.read()
    except OSError:
        return ""


def describe_blas(
    environ: Mapping[str, str] | None = None,
    *,
    maps: str | None = None,
    platform: str | None = None,
) -> str:
    """One line for the startup log saying which BLAS MLX's CPU backend uses."""
    environ = os.environ if environ is None else environ
    platform = sys.platform if platform is None else platform
    if platform == "darwin":
        return "BLAS: Accelerate (macOS)"
    maps = _read_maps() if maps is None else maps
    mapped = [line.split()[-1] for line in maps.splitlines() if len(line.split()) >= 6]
    optimized_mapped = [path for path in mapped if _OPTIMIZED_LIBRARY.search(path)]
    optimized_preloaded = [path for path in _preloaded(environ) if _OPTIMIZED_LIBRARY.search(path)]
    if optimized_preloaded:
        kind = _library_kind(optimized_preloaded[0])
        return f"BLAS: {kind} preloaded from {optimized_preloaded[0]}"
    if optimized_mapped:
        kind = _library_kind(optimized_mapped[0])
        return f"BLAS: {kind} loaded from {optimized_mapped[0]}"
    return "BLAS: reference BLAS bundled with mlx (slow; install libopenblas0)"


def _library_kind(path: str) -> str:
    name = os.path.basename(path)
    if "openblas" in name:
        return "OpenBLAS"
    if "mkl" in name:
        return "MKL"
    return "BLIS"

#!/usr/bin/env bash
# Makes .venv with mlxcel and its test tools, once (again when pyproject.toml
# changes), and puts Debian's OpenBLAS on the machine where it can: MLX's
# Linux CPU wheel ships a slow reference BLAS, and mlxcel preloads OpenBLAS
# when it finds it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
python=${PYTHON:-python3}
# Pinned like mlx-lm; installed with --no-deps below.
MLX_VLM_VERSION=0.7.10

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else return 1; fi
}

apt_install() {
  command -v apt-get >/dev/null || return 1
  as_root apt-get update -qq >/dev/null 2>&1 || true
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null 2>&1
}

if [ ! -x .venv/bin/python ]; then
  if ! "$python" -m venv .venv 2>/dev/null; then
    # Debian's python3 leaves venv/ensurepip in a separate package.
    rm -rf .venv
    version=$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    apt_install "python${version}-venv" || apt_install python3-venv || {
      echo "setup: '$python -m venv' failed; install python3-venv" >&2; exit 1; }
    "$python" -m venv .venv
  fi
fi

stamp=.venv/.mlxcel-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/setup.sh -nt "$stamp" ]; then
  echo "setup: installing mlxcel and its dependencies into .venv (first run takes a minute)" >&2
  .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
  # mlx-vlm without its declared dependencies (see pyproject.toml: what it imports is listed there).
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps "mlx-vlm==${MLX_VLM_VERSION}"
  touch "$stamp"
fi

if [ "$(uname -s)" = Linux ] && ! .venv/bin/python -c 'import sys; from mlxcel.blas import find_optimized_blas; sys.exit(find_optimized_blas() is None)'; then
  echo "setup: installing Debian's libopenblas0 (MLX's bundled BLAS is ~40x slower)" >&2
  apt_install libopenblas0 || echo "setup: could not install libopenblas0; running on the slow reference BLAS" >&2
fi

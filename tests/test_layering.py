"""mlxcel.cache is pure logic: it must import neither trio nor mlx, nor the rest of mlxcel."""

from __future__ import annotations

import ast
from pathlib import Path

import mlxcel

CACHE = Path(mlxcel.__file__).parent / "cache"
FORBIDDEN_ROOTS = {"trio", "mlx", "mlx_lm"}


def _imported_modules(path: Path) -> list[str]:
    modules = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                modules.append("mlxcel.cache." + (node.module or ""))
            else:
                modules.append(node.module or "")
    return modules


def test_cache_package_has_modules() -> None:
    assert {"key.py", "store.py", "trie.py", "apc.py", "capacity.py"} <= {p.name for p in CACHE.glob("*.py")}


def test_cache_imports_neither_trio_nor_mlx() -> None:
    offenders = []
    for path in sorted(CACHE.glob("*.py")):
        for module in _imported_modules(path):
            root = module.split(".")[0]
            if root in FORBIDDEN_ROOTS:
                offenders.append(f"{path.name}: {module}")
            elif root == "mlxcel" and not module.startswith("mlxcel.cache"):
                offenders.append(f"{path.name}: {module} (outside mlxcel.cache)")
    assert not offenders, "pure cache modules import: " + ", ".join(offenders)

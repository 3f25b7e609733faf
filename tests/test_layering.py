"""Layering: the pure modules import neither trio nor MLX, only the device touches MLX, no import goes up.

Imports are read from the source (the whole AST, so imports inside functions
and under `if TYPE_CHECKING:` count too), not by importing anything. A pure
module may import other mlxcel modules only if they are pure in the same
sense, so the check follows mlxcel imports transitively. Package
`__init__` files that Python runs on the way (`mlxcel/__init__.py` starts
the whole engine) are not followed: the rule is about what a module itself
depends on.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

import mlxcel

PACKAGE = Path(mlxcel.__file__).parent
CACHE = PACKAGE / "cache"
ACTORS = PACKAGE / "actors"
FORBIDDEN_ROOTS = {"trio", "mlx", "mlx_lm", "zmq"}
MLX_ROOTS = {"mlx", "mlx_lm"}

# Plain synchronous logic: no Trio, no MLX, however deep the mlxcel imports go.
PURE_MODULES = (
    "mlxcel.blas",
    "mlxcel.cache",
    "mlxcel.core",
    "mlxcel.disk.index",
    "mlxcel.config",
    "mlxcel.errors",
    "mlxcel.types",
    "mlxcel.http.validation",
    "mlxcel.http.guards",
    "mlxcel.model.family",
    "mlxcel.model.info",
    "mlxcel.model.adapters",
    "mlxcel.model.chat_template",
    "mlxcel.model.prompt",
    "mlxcel.model.tokenize",
    "mlxcel.vision.images",
    "mlxcel.vision.processing",
    "mlxcel.vision.prompt",
    "mlxcel.fixtures.folders",
    "mlxcel.fixtures.tokenizer",
    "mlxcel.bench.summary",
    "mlxcel.bench.workload",
)

# The packages from the bottom up: a module imports only its own package's modules and those of
# packages on lower rows (packages on one row import neither the other). `mlxcel` is the package's
# own __init__ (the public surface); top-level modules count as packages, and a module named here
# (model.family) stands apart from its package, on its own row.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "blas"),
    ("cache",),
    ("types",),
    # Plain leaves (they import nothing of mlxcel) that the configuration reads, and the core.
    ("model.family", "model.adapters", "model.parser_names", "core.grammar_bounds"),
    ("config",),
    ("core", "vision"),
    ("model",),
    ("disk", "fixtures", "bench"),
    ("actors",),
    ("engine",),
    ("http",),
    ("cli", "mlxcel"),
    ("__main__",),
)
LAYER_OF = {package: row for row, packages in enumerate(LAYERS) for package in packages}
# The disk tier's only file that runs MLX: the device thread's half.
DISK_DEVICE = "mlxcel.disk.device"


def _module_file(module: str) -> Path | None:
    """The source of an mlxcel module (or package), or None for anything else."""
    parts = module.split(".")
    if parts[0] != "mlxcel":
        return None
    base = PACKAGE.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
    return ".".join(parts)


def _package_of(path: Path) -> str:
    name = _module_name(path)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


@functools.cache
def _imported_modules(path: Path) -> tuple[str, ...]:
    """Every module `path` imports anywhere in its source, relative imports resolved."""
    modules: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = _package_of(path).split(".")
                base = ".".join(package[: len(package) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            modules.append(module)
            # `from mlxcel.cache import key` imports the submodule.
            modules.extend(
                f"{module}.{alias.name}" for alias in node.names if _module_file(f"{module}.{alias.name}") is not None
            )
    return tuple(modules)


def _sources(package_or_module: str) -> list[Path]:
    path = _module_file(package_or_module)
    assert path is not None, f"{package_or_module} has no source"
    return sorted(path.parent.glob("*.py")) if path.name == "__init__.py" else [path]


def _import_chains(path: Path) -> dict[str, list[str]]:
    """Each module reachable from `path` through mlxcel imports -> the chain of modules that leads there."""
    chains = {_module_name(path): [_module_name(path)]}
    todo = [path]
    while todo:
        current = todo.pop()
        chain = chains[_module_name(current)]
        for module in _imported_modules(current):
            if module in chains:
                continue
            chains[module] = [*chain, module]
            target = _module_file(module)
            if target is not None and target.name != "__init__.py":
                todo.append(target)
    return chains


def _forbidden_imports(path: Path, roots: set[str]) -> list[str]:
    return [
        " -> ".join(chain)
        for module, chain in _import_chains(path).items()
        if module.split(".")[0] in roots
    ]


def test_cache_package_has_modules() -> None:
    assert {"key.py", "store.py", "trie.py", "apc.py", "capacity.py"} <= {p.name for p in CACHE.glob("*.py")}


def test_cache_imports_nothing_of_mlxcel_beyond_itself() -> None:
    offenders = [
        f"{path.name}: {module}"
        for path in sorted(CACHE.glob("*.py"))
        for module in _imported_modules(path)
        if module.split(".")[0] == "mlxcel" and not module.startswith("mlxcel.cache")
    ]
    assert not offenders, "mlxcel.cache modules import: " + ", ".join(offenders)


@pytest.mark.parametrize("package_or_module", PURE_MODULES)
def test_pure_modules_import_neither_trio_nor_mlx(package_or_module: str) -> None:
    offenders = [chain for path in _sources(package_or_module) for chain in _forbidden_imports(path, FORBIDDEN_ROOTS)]
    assert not offenders, "pure modules reach: " + "; ".join(offenders)


def test_core_imports_neither_actors_nor_http() -> None:
    offenders = [
        " -> ".join(chain)
        for path in _sources("mlxcel.core")
        for module, chain in _import_chains(path).items()
        if module.startswith(("mlxcel.actors", "mlxcel.http"))
    ]
    assert not offenders, "mlxcel.core reaches: " + "; ".join(offenders)


def test_only_the_device_actor_imports_mlx() -> None:
    offenders = [
        f"{path.name}: {module}"
        for path in _sources("mlxcel.actors")
        if path.name != "device.py"
        for module in _imported_modules(path)
        if module.split(".")[0] in MLX_ROOTS
    ]
    assert not offenders, "actors other than the device import MLX: " + ", ".join(offenders)


def _layer_package(module: str) -> str:
    """The LAYERS name of an mlxcel module: itself where LAYERS names it, else its subpackage (or top-level name)."""
    parts = module.split(".")
    if len(parts) == 1:
        return parts[0]
    named = ".".join(parts[1:])
    return named if named in LAYER_OF else parts[1]


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{module} -> {target}"
        for module, targets in sorted(graph.items())
        for target in sorted(targets)
        if _layer_package(module) != _layer_package(target)
        and LAYER_OF[_layer_package(target)] >= LAYER_OF[_layer_package(module)]
    ]


def test_every_package_has_a_layer() -> None:
    packages = {_layer_package(module) for module in _import_graph()}
    assert packages == set(LAYER_OF), (f"packages without a row in LAYERS: {sorted(packages - set(LAYER_OF))}; "
                                       f"rows naming no package: {sorted(set(LAYER_OF) - packages)}")


def test_no_import_goes_up_the_layers() -> None:
    offenders = _upward_imports(_import_graph())
    assert not offenders, "imports up (or across) the layers: " + "; ".join(offenders)


def test_the_layer_check_finds_an_upward_import() -> None:
    graph = {"mlxcel.model.disk_kv": {"mlxcel.actors.disk_tier", "mlxcel.cache.key"}, "mlxcel.core.x": {"mlxcel.vision.y"},
             "mlxcel.model.family": {"mlxcel.model.kv"}, "mlxcel.core.z": {"mlxcel.config", "mlxcel.model.family"}}
    assert _upward_imports(graph) == ["mlxcel.core.x -> mlxcel.vision.y", "mlxcel.model.disk_kv -> mlxcel.actors.disk_tier",
                                      "mlxcel.model.family -> mlxcel.model.kv"]


def test_the_disk_tier_runs_mlx_only_in_its_device_file() -> None:
    offenders = [
        chain for path in _sources("mlxcel.disk") if _module_name(path) != DISK_DEVICE
        for chain in _forbidden_imports(path, FORBIDDEN_ROOTS)
    ]
    assert not offenders, "disk-tier modules beside disk/device.py reach: " + "; ".join(offenders)


def _defines_an_actor(path: Path) -> bool:
    """A class whose ``async def run`` takes ``task_status`` and which keeps an ``inbox``."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.ClassDef):
            continue
        runs = [item for item in node.body if isinstance(item, ast.AsyncFunctionDef) and item.name == "run"
                and "task_status" in {arg.arg for arg in item.args.kwonlyargs}]
        keeps_inbox = any(isinstance(target, ast.Attribute) and target.attr == "inbox"
                          for item in ast.walk(node) if isinstance(item, ast.Assign) for target in item.targets)
        if runs and keeps_inbox:
            return True
    return False


def test_actors_holds_actors_only() -> None:
    # messages.py is the actors' one shared vocabulary (DESIGN.md); every other file there is an actor.
    others = [path.name for path in sorted(ACTORS.glob("*.py"))
              if path.name not in ("__init__.py", "messages.py") and not _defines_an_actor(path)]
    assert not others, "mlxcel/actors holds modules that define no actor: " + ", ".join(others)


def test_the_actor_check_tells_an_actor_from_a_helper() -> None:
    assert _defines_an_actor(ACTORS / "warmer.py")
    assert not _defines_an_actor(PACKAGE / "disk" / "tier.py")
    assert not _defines_an_actor(PACKAGE / "model" / "grammar_check.py")


def test_the_import_walk_sees_what_it_must() -> None:
    # The checks above are only as good as this walk: function-level, relative and submodule imports.
    source = PACKAGE / "engine.py"
    imported = _imported_modules(source)
    assert "trio" in imported
    assert "mlxcel.fixtures.text" in imported  # imported inside run_engine
    assert any(chain[-1] == "mlx.core" for chain in _import_chains(source).values())


def _import_graph() -> dict[str, set[str]]:
    """mlxcel module -> the mlxcel modules it imports anywhere in its source (packages' __init__ not followed)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        targets = (_module_file(module) for module in _imported_modules(path))
        graph[_module_name(path)] = {
            _module_name(target) for target in targets if target is not None and target.name != "__init__.py"
        }
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: one path around each module that can reach itself."""
    circles: list[list[str]] = []
    seen: set[str] = set()
    for start in sorted(graph):
        todo, paths = [start], {start: [start]}
        while todo:
            current = todo.pop()
            for module in sorted(graph.get(current, ())):
                if module == start and not seen.intersection(paths[current]):
                    circles.append([*paths[current], start])
                    seen.update(paths[current])
                elif module not in paths:
                    paths[module] = [*paths[current], module]
                    todo.append(module)
    return circles


def test_no_import_circle() -> None:
    circles = _circles(_import_graph())
    assert not circles, "import circles: " + "; ".join(" -> ".join(circle) for circle in circles)


def test_the_circle_check_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c", "a"]]

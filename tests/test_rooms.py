"""DESIGN.md §2: a module never imports from a room to its right (lazy imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "zmq_omni"
ORDER = [
    "metrics",
    "errors",
    "config",
    "wire",
    "shm",
    "transport",
    "connectors",
    "adapters",
    "aio",
    "stages",
    "bench",
    "cli",
]


def _room(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "zmq_omni" or len(parts) < 2:
        return None
    return parts[1]


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[str]:
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.append(target)
            found.extend(f"{target}.{alias.name}" for alias in node.names)
    return found


def test_no_module_imports_from_a_room_to_its_right() -> None:
    wrong: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent == PACKAGE and path.name == "__init__.py":
            continue  # the package surface re-exports every room
        source = _room(_module_name(path))
        assert source in ORDER, f"{path} is in no room of DESIGN.md §2"
        for target in _imports(path):
            room = _room(target)
            if room in ORDER and ORDER.index(room) > ORDER.index(source):
                wrong.append(f"{_module_name(path)} imports {target}")
    assert wrong == []


def test_metrics_is_a_leaf() -> None:
    assert [t for t in _imports(PACKAGE / "metrics.py") if t.startswith("zmq_omni")] == []

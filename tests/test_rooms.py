"""The package's rooms and the imports allowed between them (docs/architecture.md, "Rooms").

The rooms, each importing only from rooms to its left (lazy imports included)::

    errors <- config <- wire <- shm <- transport <- connectors <- adapters <- aio, stages <- bench <- cli

``metrics`` is a leaf every room may use. ``aio`` and ``stages`` stand side by
side: both build on the adapters and neither imports the other. A room never
imports another room's private (underscore) modules or names: what two rooms
share is public in the room that owns it.

Inside a room the modules import each other in one order: the graph of their
imports (lazy and ``TYPE_CHECKING`` imports included, read from the source with
``ast``) has no circle.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "zmq_omni"

# Left to right; the rooms of one tuple share a rank and may not import each other.
RANKS: list[tuple[str, ...]] = [
    ("metrics",),
    ("errors",),
    ("config",),
    ("wire",),
    ("shm",),
    ("transport",),
    ("connectors",),
    ("adapters",),
    ("aio", "stages"),
    ("bench",),
    ("cli",),
]
RANK = {room: rank for rank, rooms in enumerate(RANKS) for room in rooms}


def _room(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "zmq_omni" or len(parts) < 2:
        return None
    return parts[1]


def _module_name(path: Path, package: Path) -> str:
    rel = path.relative_to(package.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _import_statements(path: Path, package: Path) -> Iterator[tuple[str, list[str]]]:
    """``(module, names)`` of each import in ``path``, relative imports resolved; ``names`` empty for ``import m``."""
    name = _module_name(path, package)
    base_package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = base_package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            yield target, [alias.name for alias in node.names]


def _imports(path: Path, package: Path) -> list[str]:
    """Every module, and every ``module.name``, that ``path`` imports, relative imports resolved."""
    found: list[str] = []
    for target, names in _import_statements(path, package):
        found.append(target)
        found.extend(f"{target}.{name}" for name in names)
    return found


def _is_private(target: str) -> bool:
    """``zmq_omni.shm._owner`` or ``zmq_omni.adapters.base._Burst``: a part after the room starts with ``_``."""
    return any(part.startswith("_") and not part.startswith("__") for part in target.split(".")[2:])


def _violations(package: Path) -> list[str]:
    """Each import that breaks a rule of the module docstring, as ``module imports target (why)``."""
    wrong: list[str] = []
    for path in sorted(package.rglob("*.py")):
        if path.parent == package and path.name == "__init__.py":
            continue  # the package surface re-exports every room
        module = _module_name(path, package)
        source = _room(module)
        if source not in RANK:
            wrong.append(f"{module} is in no room")
            continue
        for target in _imports(path, package):
            room = _room(target)
            if room not in RANK or room == source:
                continue  # outside the package, the package surface (__version__), or its own room
            if RANK[room] > RANK[source]:
                wrong.append(f"{module} imports {target} (a room to its right)")
            elif RANK[room] == RANK[source]:
                wrong.append(f"{module} imports {target} (a room beside it)")
            elif _is_private(target):
                wrong.append(f"{module} imports {target} (another room's private module or name)")
    return wrong


def _room_graphs(package: Path) -> dict[str, dict[str, set[str]]]:
    """Room -> module -> the modules of the same room it imports.

    ``from pkg import name`` depends on ``pkg.name`` when that is a module (``pkg``
    itself is already being imported then), else on ``pkg``, whose ``__init__``
    defines or re-exports ``name``.
    """
    modules = {_module_name(path, package): path for path in sorted(package.rglob("*.py"))}
    graphs: dict[str, dict[str, set[str]]] = {}
    for module, path in modules.items():
        room = _room(module)
        if room is None:
            continue
        edges = graphs.setdefault(room, {}).setdefault(module, set())
        for target, names in _import_statements(path, package):
            wanted = [f"{target}.{name}" if f"{target}.{name}" in modules else target for name in names] or [target]
            edges.update(t for t in wanted if t in modules and t != module and _room(t) == room)
    return graphs


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """The groups of modules that import each other, directly or around a circle (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group: set[str] = set()
            while node not in group:
                group.add(stack.pop())
            groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [group for group in groups if len(group) > 1]


def _circle_path(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """The shortest circle through the group's first module, in import order (the first module ends it too)."""
    start = min(group)
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        if start in graph[node]:
            path = [node]
            while path[-1] != start:
                path.append(came_from[path[-1]])
            return [*reversed(path), start]
        for nxt in sorted(graph[node] & group):
            if nxt not in came_from:
                came_from[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"no circle through {start}")


def _circles(package: Path) -> list[str]:
    """Each import circle inside a room, as ``room: a -> b -> a``."""
    found: list[str] = []
    for room, graph in sorted(_room_graphs(package).items()):
        for group in _strongly_connected(graph):
            path = " -> ".join(_circle_path(graph, group))
            found.append(f"{room}: {path}")
    return sorted(found)


def test_every_import_keeps_to_the_rooms() -> None:
    assert _violations(PACKAGE) == []


def test_every_room_exists_and_every_module_is_in_one() -> None:
    present = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    present |= {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    assert present == set(RANK)


def test_metrics_is_a_leaf() -> None:
    assert [t for t in _imports(PACKAGE / "metrics.py", PACKAGE) if t.startswith("zmq_omni")] == []


def test_the_check_catches_each_kind_of_wrong_import(tmp_path: Path) -> None:
    package = tmp_path / "zmq_omni"
    files = {
        "__init__.py": "from .stages import StageWorker\n",  # the surface may import any room
        "errors.py": "",
        "config/__init__.py": "from .fields import read_int\n",
        "config/_fields.py": "",
        "config/fields.py": "from ._fields import read_int\n",  # its own room's private module
        "connectors/__init__.py": "from ..config.fields import read_int\n",
        "connectors/shm.py": "from ..config._fields import read_int\n",
        "adapters/__init__.py": "def later():\n    from zmq_omni.stages import worker\n",
        "adapters/base.py": "from ..connectors.shm import _Helper\n",
        "aio/__init__.py": "from ..stages.worker import StageWorker\n",
        "stages/__init__.py": "",
        "stages/worker.py": "import zmq_omni.config._fields\nfrom .. import errors\n",
        "cli/__init__.py": "from .. import __version__\nfrom ..stages import worker\n",
        "lost/__init__.py": "",
    }
    for name, text in files.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    assert _violations(package) == [
        "zmq_omni.adapters imports zmq_omni.stages (a room to its right)",
        "zmq_omni.adapters imports zmq_omni.stages.worker (a room to its right)",
        "zmq_omni.adapters.base imports zmq_omni.connectors.shm._Helper (another room's private module or name)",
        "zmq_omni.aio imports zmq_omni.stages.worker (a room beside it)",
        "zmq_omni.aio imports zmq_omni.stages.worker.StageWorker (a room beside it)",
        "zmq_omni.connectors.shm imports zmq_omni.config._fields (another room's private module or name)",
        "zmq_omni.connectors.shm imports zmq_omni.config._fields.read_int (another room's private module or name)",
        "zmq_omni.lost is in no room",
        "zmq_omni.stages.worker imports zmq_omni.config._fields (another room's private module or name)",
    ]


def test_no_room_imports_in_a_circle() -> None:
    circles = _circles(PACKAGE)
    for circle in circles:
        print(circle)
    assert circles == []


def test_the_circle_check_reads_lazy_typing_and_package_imports(tmp_path: Path) -> None:
    package = tmp_path / "zmq_omni"
    files = {
        "__init__.py": "",
        "shm/__init__.py": "from .pool import Pool\nfrom .sweep import sweep\n",
        "shm/pool.py": "class Pool:\n    def __init__(self):\n        from .sweep import sweep\n",
        "shm/sweep.py": "from .mailbox import Box\n",
        "shm/mailbox.py": "from .pool import Pool\n",
        "stages/__init__.py": "",
        "stages/keys.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .pipeline import P\n",
        "stages/pipeline.py": "from .keys import K\n",
        "wire/__init__.py": "from ._codec import encode\n",
        "wire/_codec.py": "from . import _dtypes\n",  # the package is being imported already: no circle
        "wire/_dtypes.py": "",
        "aio/__init__.py": "from ._connector import AsyncConnector\n",
        "aio/_connector.py": "from . import AsyncConnector\n",  # a name of the package's own __init__
    }
    for name, text in files.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    assert _circles(package) == [
        "aio: zmq_omni.aio -> zmq_omni.aio._connector -> zmq_omni.aio",
        "shm: zmq_omni.shm.mailbox -> zmq_omni.shm.pool -> zmq_omni.shm.sweep -> zmq_omni.shm.mailbox",
        "stages: zmq_omni.stages.keys -> zmq_omni.stages.pipeline -> zmq_omni.stages.keys",
    ]

"""Configs read by their field declarations (config/reader.py): each default written once, and documented."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest

from zmq_omni.adapters import RetryPolicy
from zmq_omni.adapters.chunk import ChunkManagerConfig
from zmq_omni.adapters.kv import KVTransferConfig
from zmq_omni.config import ZmqConnectorConfig
from zmq_omni.config.reader import declared_defaults, read_config, read_fields, setting
from zmq_omni.connectors.shm import SharedMemoryConfig
from zmq_omni.errors import ConfigError
from zmq_omni.stages import PipelineConfig, load_pipeline_config

DOCS = Path(__file__).resolve().parent.parent / "docs"

#: Each config read by its declarations, and the least a dict must hold to build one.
READ_BY_DECLARATION: list[tuple[type, Any]] = [
    (ZmqConnectorConfig, lambda: ZmqConnectorConfig.from_dict({})),
    (SharedMemoryConfig, lambda: SharedMemoryConfig.from_dict({})),
    (RetryPolicy, lambda: RetryPolicy.from_dict({})),
    (KVTransferConfig, lambda: KVTransferConfig.from_dict({"from_stage": "0", "to_stage": "1"})),
    (ChunkManagerConfig, lambda: ChunkManagerConfig.from_dict({"stage_id": "s"})),  # no numeric neighbours
    (
        PipelineConfig,
        lambda: load_pipeline_config({"pipeline": {"stages": [{"name": "a", "stage_id": 0, "function": "m:f"}]}}),
    ),
]

#: The typed readers whose calls carry a default of their own: a config read by declaration calls none of them.
TYPED_READERS = {"read_int", "read_float", "read_bool", "read_str", "read_choice"}


@pytest.mark.parametrize(("cls", "build"), READ_BY_DECLARATION, ids=lambda v: getattr(v, "__name__", ""))
def test_what_an_empty_dict_gives_is_the_declared_default_of_every_key(cls: type, build: Any) -> None:
    built = build()
    defaults = declared_defaults(cls)
    assert defaults, cls
    for name, default in defaults.items():
        if name == "retryable":
            assert getattr(built, name) is default
            continue
        assert getattr(built, name) == default, name


@pytest.mark.parametrize(
    "cls", [ZmqConnectorConfig, SharedMemoryConfig, RetryPolicy, KVTransferConfig, ChunkManagerConfig]
)
def test_from_dict_writes_no_default_of_its_own(cls: type) -> None:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.from_dict.__func__)))  # type: ignore[attr-defined]
    called = {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    assert called & TYPED_READERS == set()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({}, "missing required config key 'chunk_manager.stage_id'"),
        ({"stage_id": 1, "shutdown_grace_s": -1}, "config key 'chunk_manager.shutdown_grace_s' must be >= 0, got -1"),
        ({"stage_id": 1, "concat_axis": 0.5}, "config key 'chunk_manager.concat_axis' must be an integer, got 0.5"),
        ({"stage_id": 1, "retry": {"attempts": 0}}, "config key 'chunk_manager.retry.attempts' must be >= 1, got 0"),
        ({"stage_id": 1, "connector": 3}, "chunk_manager.connector: expected a mapping, got int"),
        ({"stage_id": 1, "stall_timeout_s": 0}, "'stall_timeout_s' and 'recv_wait_s' must be > 0"),
        ({"stage_id": 1, "max_queued_chunks": 0}, "'max_queued_chunks' must be >= 1, got 0"),
    ],
)
def test_the_chunk_managers_messages_name_the_key(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        ChunkManagerConfig.from_dict(data)
    assert str(caught.value) == message


# -- the reader ---------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class _Sample:
    name: str
    count: int = dataclasses.field(default=3, metadata={})
    ratio: float = setting(0.5, minimum=0.0, maximum=1.0)
    mode: Literal["push", "pull"] = "push"
    level: str | None = setting(None, choices=("low", "high"))
    tags: tuple[str, ...] = setting(default_factory=tuple, read=lambda data, key, path: tuple(data[key]))
    secret: str | None = setting(None, repr=False)
    anything: object = None


def test_the_reader_follows_types_bounds_and_choices() -> None:
    got = _Sample(
        **read_fields(_Sample, {"name": 7, "ratio": 1, "mode": "pull", "tags": ["a"]}, "s", skip=["anything"])
    )
    assert got == _Sample(name="7", ratio=1.0, mode="pull", tags=("a",))
    assert "secret" not in repr(got)
    assert read_fields(_Sample, {"name": "n", "count": None}, "s", skip=["anything"])["count"] == 3  # None: the default


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({}, "missing required config key 's.name'"),
        ({"name": "n", "count": "3"}, "config key 's.count' must be an integer, got '3'"),
        ({"name": "n", "ratio": 2}, "config key 's.ratio' must be <= 1.0, got 2"),
        ({"name": "n", "ratio": -1}, "config key 's.ratio' must be >= 0.0, got -1"),
        ({"name": "n", "mode": "both"}, "config key 's.mode' must be one of push, pull; got 'both'"),
        ({"name": "n", "level": "mid"}, "config key 's.level' must be one of low, high; got 'mid'"),
    ],
)
def test_the_reader_names_the_key_in_every_error(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        read_fields(_Sample, data, "s", skip=["anything"])
    assert str(caught.value) == message


def test_a_type_without_a_reader_is_a_programming_error_when_it_is_read() -> None:
    assert read_fields(_Sample, {"name": "n"}, "s")["anything"] is None  # absent: its default
    with pytest.raises(TypeError, match=r"_Sample\.anything: no reader"):
        read_fields(_Sample, {"name": "n", "anything": 1}, "s")


def test_read_config_refuses_unknown_keys_and_leaves_unread_fields_at_their_default() -> None:
    assert read_config(_Sample, {"name": "n", "count": 4}, "s", unread=["anything"]) == _Sample(name="n", count=4)
    for data in ({"name": "n", "nope": 1}, {"name": "n", "anything": 1}):
        with pytest.raises(ConfigError, match=r"unknown config key 's\.(nope|anything)' \(known: count, level, mode,"):
            read_config(_Sample, data, "s", unread=["anything"])


# -- the docs list every key with its default -----------------------------------------------------
#: Where each config's keys are listed (docs/configuration.md, and the connector pages it links for an
#: ``extra``): the page, the line that starts the table or paragraph, and the fields not listed.
DOCUMENTED: list[tuple[type, str, str, tuple[str, ...]]] = [
    (PipelineConfig, "configuration.md", "## `pipeline`", ("transfer",)),  # transfer: stage_args / runtime
    (RetryPolicy, "configuration.md", "### `pipeline.retry`", ("retryable",)),  # a predicate: not from YAML
    (ChunkManagerConfig, "configuration.md", "`ChunkManagerConfig` (", ()),
    (KVTransferConfig, "configuration.md", "`KVTransferConfig` (", ()),
    (ZmqConnectorConfig, "zmq-connector.md", "| key | default | meaning |", ()),
    (SharedMemoryConfig, "shared-memory.md", "| key | default | meaning |", ()),
]

#: Defaults read from the environment or derived from another key, and how the docs say so.
SPELLED_OUT = {
    "replica_id": "$VLLM_OMNI_REPLICA_ID",
    "local_rank": "$LOCAL_RANK",
    "shm_dir": "$ZMQ_OMNI_SHM_DIR",
    "spill_dir": "temp dir",
    "bind": "endpoint of",
}
_UNITS = ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))


def _spellings(value: Any) -> list[str]:
    """The ways a page may write ``value``."""
    if value is None:
        return ["none", "not given", "\u2013"]
    if isinstance(value, bool):
        return [str(value).lower()]
    if isinstance(value, RetryPolicy):
        return ["defaults"]
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict) or hasattr(value, "items"):
        return ["{}"] if not value else []
    if isinstance(value, float) and value.is_integer():
        return [repr(value), str(int(value))]
    spelled = [str(value), f"{value:,}"]
    if isinstance(value, int):
        spelled += [f"{value // unit} {name}" for unit, name in _UNITS if value >= unit and value % unit == 0]
    return spelled


def _section(page: str, start: str) -> list[str]:
    """The lines of ``page`` from the one that starts with ``start`` to the end of its first table or paragraph."""
    lines = (DOCS / page).read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(start))
    taken: list[str] = []
    for line in lines[first:]:
        if taken and (line.startswith("#") or (taken[-1].startswith("|") and not line.startswith("|"))):
            break
        taken.append(line)
    return taken


def _documented_defaults(lines: list[str]) -> dict[str, str]:
    """Key -> the text that gives its default: table rows with a ``default`` column, and ``key`` (default)."""
    found: dict[str, str] = {}
    column = None
    for line in lines:
        if not line.startswith("|"):
            column = None
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if column is None:
            column = cells.index("default") if "default" in cells else -1
            continue
        if column < 0 or len(cells) <= column or set(cells[0]) <= {"-", " "}:
            continue
        for key in re.findall(r"`([a-z_]+)`", cells[0]):
            found.setdefault(key, cells[column])
    for key, default in re.findall(r"`([a-z_]+)` \(([^)]*)\)", "\n".join(lines)):
        found.setdefault(key, default)
    return found


@pytest.mark.parametrize(("cls", "page", "start", "unlisted"), DOCUMENTED, ids=lambda v: getattr(v, "__name__", ""))
def test_the_docs_list_every_key_with_its_default(cls: type, page: str, start: str, unlisted: tuple[str, ...]) -> None:
    documented = _documented_defaults(_section(page, start))
    defaults = declared_defaults(cls)
    for field in dataclasses.fields(cls):
        if field.name in unlisted:
            continue
        assert field.name in documented, f"{page} does not list {cls.__name__}.{field.name}"
        text = documented[field.name]
        if field.name in SPELLED_OUT:
            expected = [SPELLED_OUT[field.name]]
        elif field.name not in defaults:
            expected = ["required", "{stage_id: driver}"]  # the driver's spec is built when absent
        else:
            expected = _spellings(defaults[field.name])
        assert any(re.search(rf"(?<![\w.]){re.escape(s)}(?![\w.])", text, re.I) for s in expected), (
            f"{page}: {cls.__name__}.{field.name} default {text!r}, expected one of {expected}"
        )

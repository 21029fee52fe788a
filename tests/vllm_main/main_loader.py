"""How vllm-omni main (d6240742) turns a deploy YAML into the ``extra`` each connector is built from.

Re-stated from main's code, not copied:

- ``load_omni_transfer_config`` (``distributed/omni_connectors/utils/initialization.py``):
  one ``ConnectorSpec(name, extra)`` per edge ``(from, to)`` (string stage ids),
  from ``input_connectors`` / ``output_connectors`` naming a top-level
  connector; edges named only by ``edges`` or ``engine_input_source`` get a
  ``SharedMemoryConnector`` with an **empty** extra. Main's loader has no
  ``default_shm_threshold`` any more: nothing else is added.
- ``get_connectors_config_for_stage``: for each edge into the stage,
  ``from_stage_X`` with ``extra`` copied and ``role`` set to ``receiver``
  unless given; for stage ``0`` only, ``to_stage_Y`` with role ``sender``.
  ``from_stage`` / ``to_stage`` are **not** injected.
- ``get_stage_connector_spec`` (``engine/stage_init_utils.py``): with
  ``async_chunk``, the first of those entries; a stage with only outgoing
  edges gets the outgoing spec with role ``sender``.
- ``OmniEngineArgs.create_model_config`` (``engine/arg_utils.py``): the
  ``stage_connector_config`` is ``{"name", "extra": copy + {"stage_id": <int>}}``.
  The stage's scheduler (``OmniChunkTransferAdapter``) and its model runner
  (``OmniConnectorModelRunnerMixin``) each build a connector from it, in the
  same process when the stage has one GPU.
- The orchestrator (``initialize_orchestrator_connectors``) builds every edge's
  connector from the edge's ``extra`` as it is (no role, no stage id) for
  names other than the transfer engines.
- The KV transfer manager builds from ``{**extra, "role": sender|receiver}``
  (``resolve_omni_kv_config_for_stage``), without a stage id.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

DEPLOY_DIR = Path(__file__).resolve().parent / "deploy"
MAIN_COMMIT = "d6240742f365cd813991b540b8ea797347aac72e"


@dataclass
class Spec:
    """Main's ``ConnectorSpec``: a registered name and the dict handed to its constructor."""

    name: str
    extra: dict[str, Any] = field(default_factory=dict)


def deploy_files() -> list[Path]:
    """The extracted deploy YAMLs, one per file of main's ``vllm_omni/deploy/`` that names a connector."""
    return sorted(DEPLOY_DIR.glob("*.yaml"))


def load_view(path: Path) -> dict[str, Any]:
    """One extracted deploy YAML."""
    loaded = yaml.safe_load(path.read_text())
    assert isinstance(loaded, dict)
    return loaded


def switch_to_zmq(view: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any]:
    """The user's edit: every connector the YAML names becomes a ``ZmqConnector``; ``ours`` is added to its extra.

    The YAML's own extra keys stay as they are (they belong to the stage input
    processors and other components).
    """
    switched = copy.deepcopy(view)
    for spec in switched["connectors"].values():
        spec["name"] = "ZmqConnector"
        spec["extra"] = {**(spec.get("extra") or {}), **ours}
    return switched


def edges(view: dict[str, Any]) -> dict[tuple[str, str], Spec]:
    """Main's ``load_omni_transfer_config``: the connector spec of every edge."""
    named = view.get("connectors") or {}
    out: dict[tuple[str, str], Spec] = {}

    def spec_of(ref: Any) -> Spec:
        conf = named[ref] if isinstance(ref, str) else ref
        return Spec(conf["name"], dict(conf.get("extra") or {}))

    for stage in view["stages"]:
        sid = str(stage["stage_id"])
        for key, ref in (stage.get("input_connectors") or {}).items():
            out.setdefault((key.replace("from_stage_", ""), sid), spec_of(ref))
        for key, ref in (stage.get("output_connectors") or {}).items():
            out.setdefault((sid, key.replace("to_stage_", "")), spec_of(ref))
    for edge in view.get("edges") or []:
        if edge.get("from") is not None and edge.get("to") is not None:
            out.setdefault((str(edge["from"]), str(edge["to"])), Spec("SharedMemoryConnector"))
    for stage in view["stages"]:
        for source in stage.get("engine_input_source") or []:
            out.setdefault((str(source), str(stage["stage_id"])), Spec("SharedMemoryConnector"))
    return out


def connectors_config_for_stage(all_edges: dict[tuple[str, str], Spec], stage_id: int) -> dict[str, dict[str, Any]]:
    """Main's ``get_connectors_config_for_stage``."""
    target = str(stage_id)
    out: dict[str, dict[str, Any]] = {}
    for (src, dst), spec in all_edges.items():
        if dst == target:
            extra = dict(spec.extra)
            extra.setdefault("role", "receiver")
            out[f"from_stage_{src}"] = {"spec": {"name": spec.name, "extra": extra}}
        elif src == target and target == "0":
            extra = dict(spec.extra)
            extra.setdefault("role", "sender")
            out[f"to_stage_{dst}"] = {"spec": {"name": spec.name, "extra": extra}}
    return out


def stage_connector_spec(all_edges: dict[tuple[str, str], Spec], stage_id: int, async_chunk: bool) -> dict[str, Any]:
    """Main's ``get_stage_connector_spec``: the spec a stage process's scheduler and worker build from."""
    if not async_chunk:
        return {}
    for entry in connectors_config_for_stage(all_edges, stage_id).values():
        return dict(entry["spec"])
    for (src, _dst), spec in all_edges.items():
        if src == str(stage_id):
            extra = dict(spec.extra)
            extra.setdefault("role", "sender")
            return {"name": spec.name, "extra": extra}
    return {}


def stage_connector_config(spec: dict[str, Any], stage_id: int) -> dict[str, Any]:
    """Main's ``create_model_config``: the spec with ``stage_id`` (an int) injected into a copy of its extra."""
    config = {"name": spec.get("name", "SharedMemoryConnector"), "extra": dict(spec.get("extra", {}))}
    config["extra"]["stage_id"] = stage_id
    return config


def kv_spec(all_edges: dict[tuple[str, str], Spec], stage_id: int) -> Spec | None:
    """Main's ``resolve_omni_kv_config_for_stage`` + the KV manager: the spec its connector is built from."""
    sid = str(stage_id)
    outgoing = sorted(((dst, spec) for (src, dst), spec in all_edges.items() if src == sid), key=lambda e: e[0])
    incoming = sorted(((src, spec) for (src, dst), spec in all_edges.items() if dst == sid), key=lambda e: e[0])
    for side, role in ((outgoing, "sender"), (incoming, "receiver")):
        if side:
            spec = side[0][1]
            extra = dict(spec.extra)
            extra.setdefault("role", role)
            return Spec(spec.name, extra)
    return None


@dataclass
class Build:
    """One connector main would build: where, from which spec."""

    path: str  # "stage-scheduler", "stage-worker", "orchestrator", "kv"
    stage_id: int | None
    name: str
    extra: dict[str, Any]


def builds(view: dict[str, Any]) -> Iterator[Build]:
    """Every connector main builds for a deploy YAML, in construction order of one host."""
    all_edges = edges(view)
    for stage in view["stages"]:
        sid = int(stage["stage_id"])
        spec = stage_connector_spec(all_edges, sid, bool(view.get("async_chunk", True)))
        if spec:
            config = stage_connector_config(spec, sid)
            yield Build("stage-scheduler", sid, config["name"], config["extra"])
            yield Build("stage-worker", sid, config["name"], copy.deepcopy(config["extra"]))
        kv = kv_spec(all_edges, sid)
        if kv is not None:
            yield Build("kv", sid, kv.name, kv.extra)
    for (_src, _dst), spec in all_edges.items():
        yield Build("orchestrator", None, spec.name, dict(spec.extra))


def processor_config(connector: object) -> dict[str, Any]:
    """What main's stage input processors read (e.g. ``qwen3_omni.py``, ``minicpmo_4_5_omni.py``), verbatim in form."""
    raw_cfg = getattr(connector, "config", {}) or {}
    cfg = raw_cfg.get("extra", raw_cfg) if isinstance(raw_cfg, dict) else {}
    return cfg if isinstance(cfg, dict) else {}

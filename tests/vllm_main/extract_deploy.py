"""Regenerate ``tests/vllm_main/deploy/*.yaml`` from a local mirror of vllm-omni.

Usage: ``python -m tests.vllm_main.extract_deploy /path/to/vllm-omni.git [commit]``.

For every ``vllm_omni/deploy/*.yaml`` at the commit whose resolved form
(``base_config`` inheritance applied, as main's ``resolve_deploy_yaml`` does)
names a connector, this writes the part main's connector loader reads:
``async_chunk`` (main's default: true), the top-level ``connectors`` and
``edges``, and per stage ``stage_id``, ``engine_input_source``,
``input_connectors`` and ``output_connectors``. Values are copied as they are.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

MAIN_COMMIT = "d6240742f365cd813991b540b8ea797347aac72e"
HERE = Path(__file__).resolve().parent / "deploy"
STAGE_KEYS = ("stage_id", "engine_input_source", "input_connectors", "output_connectors")


def _show(repo: str, commit: str, path: str) -> dict[str, Any]:
    text = subprocess.run(["git", "-C", repo, "show", f"{commit}:{path}"], capture_output=True, text=True, check=True)
    loaded = yaml.safe_load(text.stdout)
    return loaded if isinstance(loaded, dict) else {}


def _resolve(repo: str, commit: str, path: str) -> dict[str, Any]:
    raw = _show(repo, commit, path)
    base = raw.pop("base_config", None)
    if base is None:
        return raw
    merged_base = _resolve(repo, commit, str(Path(path).parent / base))
    merged = {**merged_base, **{k: v for k, v in raw.items() if k not in ("stages", "platforms")}}
    by_id = {s["stage_id"]: dict(s) for s in merged_base.get("stages") or []}
    for stage in raw.get("stages") or []:
        by_id[stage["stage_id"]] = {**by_id.get(stage["stage_id"], {}), **stage}
    merged["stages"] = list(by_id.values())
    return merged


def extract(repo: str, commit: str = MAIN_COMMIT) -> list[Path]:
    """Write one fixture per deploy YAML that names a connector; the paths written."""
    listing = subprocess.run(
        ["git", "-C", repo, "ls-tree", "--name-only", commit, "vllm_omni/deploy/"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    written = []
    for path in sorted(p for p in listing if p.endswith(".yaml")):
        resolved = _resolve(repo, commit, path)
        stages = resolved.get("stages") or []
        named = resolved.get("connectors") or any(
            s.get("input_connectors") or s.get("output_connectors") for s in stages
        )
        if not named:
            continue
        view: dict[str, Any] = {
            "source": {"repository": "vraiti/vllm-omni", "commit": commit, "path": path},
            "async_chunk": resolved.get("async_chunk", True),
            "connectors": resolved.get("connectors") or {},
            "stages": [{k: s[k] for k in STAGE_KEYS if k in s} for s in stages],
        }
        if resolved.get("edges"):
            view["edges"] = resolved["edges"]
        out = HERE / Path(path).name
        out.write_text(
            f"# Extracted from {path} of vraiti/vllm-omni at {commit}: only what main's connector loader reads.\n"
            + yaml.safe_dump(view, sort_keys=False)
        )
        written.append(out)
    return written


if __name__ == "__main__":
    for written_path in extract(*sys.argv[1:]):
        print(written_path.name)

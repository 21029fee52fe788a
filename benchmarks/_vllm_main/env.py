"""Import vllm-omni main's own modules from a checkout, with vLLM stubbed.

``install(checkout)`` makes ``import vllm_omni....`` load main's files from
``checkout`` (a tree of commit ``d6240742``) in a process that has no vLLM:

- **vLLM is stubbed** in ``sys.modules``: only the modules and names that the
  main modules loaded here import (:data:`VLLM_NAMES`). They are empty classes
  or TypedDicts, except ``vllm.v1.request.RequestStatus``, whose members and
  ``is_finished`` the chunk adapter's scheduler hooks use: it is re-stated
  from vLLM (with ``WAITING_FOR_CHUNK``, which main's ``patch.py`` adds), and
  ``vllm.logger.init_logger`` (``logging.getLogger``). No stubbed name is
  called on the path measured.
- **vllm_omni's package ``__init__`` files are not run** for the packages whose
  ``__init__`` pulls in the whole engine (``vllm_omni``, ``vllm_omni.config``,
  ``vllm_omni.distributed``, ``vllm_omni.distributed.omni_connectors``, ...): they
  become empty packages whose ``__path__`` is main's directory, so their
  modules load from main's files as they are.
- Three main modules imported at the top of a loaded module but not used by
  what is measured are replaced by placeholders whose use raises:
  ``vllm_omni.config.yaml_util`` (needs omegaconf, not installed) and
  ``vllm_omni.platforms`` (vLLM's platform detection), imported by
  ``entrypoints/stage_utils.py``, whose ``shm_write_bytes`` / ``shm_read_bytes``
  (what main's ``SharedMemoryConnector`` calls) use neither; and
  ``vllm_omni.metrics`` (needs prettytable, not installed), imported by
  ``omni_connectors/adapter.py`` for the orchestrator's helpers.

Everything else is main's code: ``data_entry_keys`` (the payload Structs),
the connector factory, ``SharedMemoryConnector`` and ``stage_utils``' segment
functions, ``OmniSerializer``, the transfer config loader, the chunk transfer
adapter and its base, and the Qwen3-Omni stage input processors.
"""

from __future__ import annotations

import enum
import logging
import sys
import types
from pathlib import Path
from typing import Any, TypedDict

import msgspec

MAIN_COMMIT = "d6240742"

#: The files a checkout must have; the harness names the first one missing.
REQUIRED_FILES = (
    "vllm_omni/distributed/omni_connectors/transfer_adapter/chunk_transfer_adapter.py",
    "vllm_omni/distributed/omni_connectors/connectors/shm_connector.py",
    "vllm_omni/distributed/omni_connectors/factory.py",
    "vllm_omni/model_executor/stage_input_processors/qwen3_omni.py",
    "vllm_omni/data_entry_keys.py",
    "vllm_omni/deploy/qwen3_omni_moe.yaml",
)

#: Packages whose ``__init__`` is not run (it imports the engine, models, omegaconf, ...).
SHELL_PACKAGES = (
    "vllm_omni",
    "vllm_omni.config",
    "vllm_omni.distributed",
    "vllm_omni.distributed.omni_connectors",
    "vllm_omni.distributed.omni_connectors.connectors",
    "vllm_omni.distributed.omni_connectors.transfer_adapter",
    "vllm_omni.distributed.omni_connectors.utils",
    "vllm_omni.entrypoints",
    "vllm_omni.model_executor",
    "vllm_omni.model_executor.stage_input_processors",
)


class CheckoutError(SystemExit):
    """The ``--vllm-omni`` directory is not a checkout of vllm-omni main."""


def check_checkout(checkout: Path) -> Path:
    """Return ``checkout`` resolved, or raise :class:`CheckoutError` naming what is missing and how to get it."""
    root = checkout.expanduser().resolve()
    for rel in REQUIRED_FILES:
        if not (root / rel).is_file():
            raise CheckoutError(
                f"--vllm-omni {checkout}: not a checkout of vllm-omni main {MAIN_COMMIT} ({rel} is missing).\n"
                "Extract one, e.g. from a clone of github.com/vraiti/vllm-omni:\n"
                f"  mkdir -p DIR && git -C CLONE archive {MAIN_COMMIT} | tar -x -C DIR"
            )
    return root


class RequestStatus(enum.IntEnum):
    """vLLM's ``vllm.v1.request.RequestStatus``, plus ``WAITING_FOR_CHUNK`` (main's ``patch.py`` adds it as -1)."""

    WAITING_FOR_CHUNK = -1
    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        """vLLM's rule: every status after ``PREEMPTED`` is finished."""
        return status > RequestStatus.PREEMPTED


def _typed_dict(name: str) -> type:
    made: type = TypedDict(name, {}, total=False)  # type: ignore[misc]  # a name known only at run time
    return made


def _struct(name: str) -> type:
    return types.new_class(name, (msgspec.Struct,), {})


def _plain(name: str) -> type:
    return type(name, (), {"__module__": "vllm (stub)"})


#: Every vLLM module and name the loaded main modules import, and what stands in for it.
VLLM_NAMES: dict[str, dict[str, Any]] = {
    "vllm": {},
    "vllm.v1": {},
    "vllm.v1.request": {"Request": _plain("Request"), "RequestStatus": RequestStatus},
    "vllm.v1.engine": {
        "EngineCoreOutput": _struct("EngineCoreOutput"),
        "EngineCoreOutputs": _struct("EngineCoreOutputs"),
        "EngineCoreRequest": _struct("EngineCoreRequest"),
    },
    "vllm.inputs": {
        "TextPrompt": _typed_dict("TextPrompt"),
        "TokensPrompt": _typed_dict("TokensPrompt"),
        "EmbedsPrompt": _typed_dict("EmbedsPrompt"),
        "PromptType": Any,
    },
    "vllm.inputs.engine": {"TokensInput": _typed_dict("TokensInput")},
    "vllm.sampling_params": {"SamplingParams": _plain("SamplingParams")},
    "vllm.outputs": {"CompletionOutput": _plain("CompletionOutput"), "RequestOutput": _plain("RequestOutput")},
    "vllm.lora": {},
    "vllm.lora.request": {"LoRARequest": _plain("LoRARequest")},
    "vllm.logger": {"init_logger": logging.getLogger},
}


class _Placeholder:
    """A name of a main module that the measured path imports but never uses: any use of it raises."""

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def _refuse(self) -> RuntimeError:
        return RuntimeError(f"{self._qualname} is a placeholder in this harness (benchmarks/_vllm_main/env.py)")

    def __getattr__(self, name: str) -> Any:
        raise self._refuse()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise self._refuse()


#: Main modules imported (at a module's top) but not used by the measured path, and their imported names.
PLACEHOLDERS = {
    "vllm_omni.config.yaml_util": ("to_dict",),
    "vllm_omni.platforms": ("current_omni_platform",),
    "vllm_omni.metrics": ("OrchestratorAggregator",),
}


def install(checkout: Path) -> None:
    """Make ``import vllm_omni....`` load main's files from ``checkout``, with vLLM stubbed. Idempotent."""
    root = check_checkout(checkout)
    if "vllm_omni" in sys.modules:
        loaded = Path(getattr(sys.modules["vllm_omni"], "__path__", [""])[0])
        if loaded != root / "vllm_omni":
            raise RuntimeError(f"vllm_omni already imported from {loaded}")
        return
    for name, attrs in VLLM_NAMES.items():
        module = types.ModuleType(name)
        module.__path__ = []  # a package: its stubbed submodules are in sys.modules
        for attr, value in attrs.items():
            setattr(module, attr, value)
        sys.modules[name] = module
    for name in SHELL_PACKAGES:
        package = types.ModuleType(name)
        package.__path__ = [str(root.joinpath(*name.split(".")))]
        sys.modules[name] = package
    for name, names in PLACEHOLDERS.items():
        placeholder = types.ModuleType(name)
        for attr in names:
            setattr(placeholder, attr, _Placeholder(f"{name}.{attr}"))
        sys.modules[name] = placeholder

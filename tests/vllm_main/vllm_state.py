"""What vLLM's ``vllm.distributed.parallel_state`` answers in the processes of a stage, stood in for tests.

vLLM's multiprocess executor passes each worker its rank as an argument (it
sets no ``LOCAL_RANK``) and sets up the tensor-parallel group in the worker
before the model runner builds its connectors; there
``get_tensor_model_parallel_rank()`` returns the worker's rank in its TP group.
The EngineCore process (which builds the scheduler's connector) has imported
the module but set up no group: vLLM's ``get_tp_group`` asserts. vllm-omni main
reads the rank this way (``kv_utils.get_local_tp_rank``, the mixin's
``is_data_transfer_rank``). :func:`install` puts such a module in
``sys.modules`` (vLLM itself is not installed here).
"""

from __future__ import annotations

import sys
import types

MODULE = "vllm.distributed.parallel_state"


def parallel_state(rank: int | None, world_size: int = 1) -> types.ModuleType:
    """The module as a TP worker of rank ``rank`` sees it; ``rank=None``: as the EngineCore sees it."""
    module = types.ModuleType(MODULE)

    def get_tensor_model_parallel_rank() -> int:
        assert rank is not None, "tensor model parallel group is not initialized"
        return rank

    def get_tensor_model_parallel_world_size() -> int:
        assert rank is not None, "tensor model parallel group is not initialized"
        return world_size

    module.get_tensor_model_parallel_rank = get_tensor_model_parallel_rank  # type: ignore[attr-defined]
    module.get_tensor_model_parallel_world_size = get_tensor_model_parallel_world_size  # type: ignore[attr-defined]
    return module


def install(rank: int | None, world_size: int = 1) -> None:
    """Make this process a TP worker of ``rank`` (or, with None, an EngineCore) in vLLM's eyes."""
    for parent in ("vllm", "vllm.distributed"):
        sys.modules.setdefault(parent, types.ModuleType(parent))
    sys.modules[MODULE] = parallel_state(rank, world_size)

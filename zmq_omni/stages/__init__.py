"""Stages: run a pipeline stage, or drive a pipeline, on top of the adapters.

:class:`StageWorker` owns the connectors of a stage's two edges and an
:class:`~zmq_omni.adapters.OmniChunkManager`, and calls a user function per
received chunk; :class:`PipelineDriver` submits requests to the first stage
and collects the last stage's output; :func:`load_pipeline_config` reads the
pipeline YAML both are built from. :mod:`zmq_omni.stages.keys` writes and
reads the CURVE key files of a pipeline (``zmq-omni keygen``).
"""

from __future__ import annotations

from .driver import DriverEvent, PipelineDriver
from .pipeline import ChunkFunction, PipelineConfig, StageSpec, load_pipeline_config, name_stages
from .worker import StageWorker

__all__ = [
    "ChunkFunction",
    "DriverEvent",
    "PipelineConfig",
    "PipelineDriver",
    "StageSpec",
    "StageWorker",
    "load_pipeline_config",
    "name_stages",
]

"""The benchmark grids behind ``zmq-omni bench`` and ``benchmarks/*.py``.

One module per grid, each with a ``run_*`` function that takes the sizes and a
repetition budget and returns rows of figures measured beside their baselines
in the same run; every row turns into :class:`Comparison` cells (ours,
baseline, ratio) for the one ratio table of ``zmq-omni bench``:

* :mod:`zmq_omni.bench.codec`: the wire codec against pickle-5, msgpack and memcpy;
* :mod:`zmq_omni.bench.transport`: ZmqConnector throughput and message rate against raw pyzmq;
* :mod:`zmq_omni.bench.latency`: the round trip of one message in flight against raw pyzmq;
* :mod:`zmq_omni.bench.shm`: the shared-memory fast path against memcpy, a vllm-style path and raw pyzmq;
* :mod:`zmq_omni.bench.adapters`: scheduler-thread hold times and chunk latency;
* :mod:`zmq_omni.bench.vllm_pipeline`: vllm-omni's three-stage pipeline with main's call patterns
  against main's SharedMemoryConnector (restated); needs torch and msgspec.

Grids print nothing: the command line (``zmq-omni bench``, the scripts) does.
"""

from __future__ import annotations

from ._common import KIB, MIB, Comparison, parse_size, size_label

__all__ = ["KIB", "MIB", "Comparison", "parse_size", "size_label"]

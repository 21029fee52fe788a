"""The three stage functions of the demo pipeline: thinker -> talker -> vocoder.

Deterministic synthetic signal processing (numpy only) standing in for the
models of a speech pipeline, with the shapes and dtypes real stages move:

* ``thinker``: per request, streams ``n_chunks`` chunks of hidden states
  (``float32 [frames, HIDDEN]``, about ``payload_size`` bytes) and token ids
  (``int64 [frames]``).
* ``talker``: turns hidden states into codec codes (``int32 [frames / GROUP, CODEBOOKS]``).
* ``vocoder``: renders codes as audio (``float32``, ``SAMPLE_RATE`` Hz): each
  code frame is a windowed sum of sinusoids whose pitches come from the codes.

Each function has the stage worker signature ``fn(request_id, payload, is_final)``.
Pipeline YAML names them as ``zmq_omni.cli.demo_stages:thinker`` and so on.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["CODEBOOKS", "GROUP", "HIDDEN", "SAMPLE_RATE", "SAMPLES_PER_CODE", "talker", "thinker", "vocoder"]

HIDDEN = 256  # hidden-state width: one frame is 1 KiB of float32
GROUP = 16  # hidden frames per codec frame
CODEBOOKS = 4  # codes per codec frame
CODE_VALUES = 1024
SAMPLE_RATE = 24_000
SAMPLES_PER_CODE = 480  # 20 ms of audio per codec frame

# A fixed projection, the same in every process (the talker's "weights").
_PROJECTION = np.random.default_rng(0).standard_normal((HIDDEN, CODEBOOKS)).astype(np.float32)
_WINDOW = np.hanning(SAMPLES_PER_CODE).astype(np.float32)
_T = np.arange(SAMPLES_PER_CODE, dtype=np.float32) / SAMPLE_RATE


def _seed(request_id: str) -> int:
    return zlib.crc32(request_id.encode())


def thinker(request_id: str, payload: dict[str, Any], is_final: bool) -> Iterator[dict[str, Any]]:
    """Stream hidden states and token ids for a request.

    ``payload``: ``n_chunks`` (int), ``payload_size`` (bytes of hidden states
    per chunk), optional ``prompt`` (str; changes the content).
    """
    n_chunks = int(payload.get("n_chunks", 8))
    frames = max(GROUP, int(payload.get("payload_size", 1 << 20)) // (HIDDEN * 4))
    frames -= frames % GROUP
    rng = np.random.default_rng(_seed(request_id + str(payload.get("prompt", ""))))
    for index in range(n_chunks):
        hidden = rng.standard_normal((frames, HIDDEN), dtype=np.float32)
        token_ids = rng.integers(0, 32_000, size=frames, dtype=np.int64)
        yield {"hidden": hidden, "token_ids": token_ids, "chunk_index": index}


def talker(request_id: str, payload: dict[str, Any], is_final: bool) -> dict[str, Any] | None:
    """Turn hidden states into codec codes (one code frame per ``GROUP`` hidden frames)."""
    hidden = payload.get("hidden")
    if hidden is None or len(hidden) == 0:
        return None  # an end-of-stream marker without data
    frames = (len(hidden) // GROUP) * GROUP
    pooled = hidden[:frames].reshape(-1, GROUP, HIDDEN).mean(axis=1)
    projected = np.abs(pooled @ _PROJECTION) * 512.0
    tokens = payload["token_ids"][:frames].reshape(-1, GROUP).sum(axis=1, keepdims=True)
    codes = ((projected.astype(np.int64) + tokens) % CODE_VALUES).astype(np.int32)
    return {"codes": codes}


def vocoder(request_id: str, payload: dict[str, Any], is_final: bool) -> dict[str, Any] | None:
    """Render codec codes as audio: per code frame, a windowed sum of sinusoids."""
    codes = payload.get("codes")
    if codes is None or len(codes) == 0:
        return None
    # Code c of codebook k sounds at 110 Hz * 2 ** (c / 256) (about 110 Hz .. 1.7 kHz), quieter for higher k.
    freqs = 110.0 * np.exp2(codes.astype(np.float32) / 256.0)  # [frames, CODEBOOKS]
    amps = (0.4 / (1.0 + np.arange(CODEBOOKS, dtype=np.float32)))[None, :, None]
    waves = amps * np.sin(2.0 * np.pi * freqs[:, :, None] * _T[None, None, :])  # [frames, K, samples]
    audio = (waves.sum(axis=1) * _WINDOW[None, :]).reshape(-1).astype(np.float32)
    return {"audio": audio, "sample_rate": SAMPLE_RATE}

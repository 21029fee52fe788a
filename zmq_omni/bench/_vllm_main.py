"""What the vllm-omni pipeline benchmark needs of vllm-omni main (``d6240742``), restated in our own code.

Facts carried over from main, not its code (main is not imported: it needs
vllm and a GPU stack):

* **Payload Structs** (``vllm_omni/data_entry_keys.py``): ``OmniPayloadStruct``
  and its nested ``HiddenStatesStruct``, ``EmbeddingsStruct``, ``IdsStruct``,
  ``CodesStruct`` and ``MetaStruct``, with main's field lists and class options
  (``msgspec.Struct, omit_defaults=True, kw_only=True,
  forbid_unknown_fields=True``), tensors as ``torch.Tensor`` fields.
* **The serializer** of main's connectors (``OmniSerializer``,
  ``distributed/omni_connectors/utils/serialization.py``): a
  ``msgspec.msgpack.Encoder`` whose ``enc_hook`` turns a tensor into
  ``{"__tensor__": True, "dtype", "shape", "data": bytes}`` (``detach().cpu()``,
  contiguous, viewed as uint8, ``.numpy().tobytes()``: one copy), and a
  ``msgspec.msgpack.Decoder`` followed by a recursive pass that rebuilds each
  tensor with ``torch.frombuffer(bytearray(data))`` (one more copy) and tests
  every dict for main's ``RequestOutput`` / ``CompletionOutput`` /
  ``OmniRequestOutput`` key sets. Not restated: the PIL, dataclass,
  ``RequestOutput`` and ``slice`` branches, which no chunk payload reaches.
* **The baseline connector**, main's ``SharedMemoryConnector``
  (``connectors/shm_connector.py`` with ``entrypoints/stage_utils.py``'s
  ``shm_write_bytes`` / ``shm_read_bytes``): ``put`` serializes, opens and
  ``flock``-s ``/dev/shm/shm_{key}_lockfile.lock``, creates a new
  ``multiprocessing.shared_memory`` segment named by the key, copies the bytes
  in and closes it; ``get`` without metadata attaches the segment by key
  (``None`` when it is not there), takes the lock, attaches it a second time to
  copy the bytes out and unlink it, deserializes, then removes the lock file.
  Only the key path is restated (the benchmark's receive loops, like main's,
  pass no metadata).
* **The chunk adapter's loops**: :mod:`zmq_omni.bench._vllm_loops`.

Everything here imports torch and msgspec: callers import this module lazily,
after :func:`zmq_omni.bench.vllm_pipeline.missing_dependencies` said both are there.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from multiprocessing import shared_memory
from typing import Any

import msgspec
import numpy as np
import torch

__all__ = [
    "CodesStruct",
    "EmbeddingsStruct",
    "HiddenStatesStruct",
    "IdsStruct",
    "MainShmConnector",
    "MetaStruct",
    "OmniPayloadStruct",
    "main_deserialize",
    "main_serialize",
]

_log = logging.getLogger("zmq_omni.bench")


# -- the payload Structs: main's field lists ------------------------------------------------------------------------
class _StructBase(msgspec.Struct, omit_defaults=True, kw_only=True, forbid_unknown_fields=True):
    pass


class HiddenStatesStruct(_StructBase):
    """Main's ``HiddenStatesStruct``."""

    output: torch.Tensor | None = None
    output_shape: list[int] | None = None
    trailing_text: torch.Tensor | None = None
    last: torch.Tensor | None = None
    layers: dict[int, torch.Tensor] | None = None


class EmbeddingsStruct(_StructBase):
    """Main's ``EmbeddingsStruct``."""

    prefill: torch.Tensor | None = None
    prefill_shape: list[int] | None = None
    decode: torch.Tensor | None = None
    decode_token_start: int | None = None
    decode_token_end: int | None = None
    cached_decode: torch.Tensor | None = None
    tts_bos: torch.Tensor | None = None
    tts_eos: torch.Tensor | None = None
    tts_pad: torch.Tensor | None = None
    tts_pad_projected: torch.Tensor | None = None
    voice: torch.Tensor | None = None
    speech_feat: torch.Tensor | None = None
    speech_token: torch.Tensor | None = None
    speech_token_len: torch.Tensor | None = None
    embedding: torch.Tensor | None = None
    thinker_reply: torch.Tensor | None = None


class CodesStruct(_StructBase):
    """Main's ``CodesStruct``."""

    audio: torch.Tensor | None = None
    ref: torch.Tensor | None = None


class IdsStruct(_StructBase):
    """Main's ``IdsStruct``."""

    all: list[int] | None = None
    prompt: list[int] | None = None
    output: list[int] | None = None
    speech_token: list[int] | None = None
    prior_image: list[int] | None = None


class MetaStruct(_StructBase):
    """Main's ``MetaStruct``."""

    finished: torch.Tensor | None = None
    is_segment_finished: torch.Tensor | None = None
    stream_finished: torch.Tensor | None = None
    request_id: str | None = None
    chunk_seq: int | None = None
    cache_epoch: int | None = None
    last_chunk: bool | None = None
    req_id: list[str] | None = None
    left_context_size: int | None = None
    right_holdback_size: int | None = None
    override_keys: list[tuple[str, str]] | None = None
    num_processed_tokens: int | None = None
    next_stage_prompt_len: int | None = None
    replace_streaming_prompt: bool | None = None
    ar_width: int | None = None
    eol_token_id: int | None = None
    visual_token_start_id: int | None = None
    visual_token_end_id: int | None = None
    gen_token_mask: torch.Tensor | None = None
    omni_task: list[str] | None = None
    height: int | None = None
    width: int | None = None
    decode_flag: bool | None = None
    codec_streaming: bool | None = None
    ref_code_len: int | None = None
    ref_context_size: int | None = None
    ref_context_request_id: str | None = None
    ref_context_included: bool | None = None
    talker_prefill_offset: int | None = None
    codec_chunk_frames: int | None = None
    codec_left_context_frames: int | None = None
    code_flat_numel: int | None = None
    omni_final_stage_id: int | None = None


class OmniPayloadStruct(_StructBase):
    """Main's ``OmniPayloadStruct``: what its chunk adapter puts."""

    hidden: torch.Tensor | None = None
    hidden_states: HiddenStatesStruct | None = None
    embed: EmbeddingsStruct | None = None
    ids: IdsStruct | None = None
    codes: CodesStruct | None = None
    meta: MetaStruct | None = None
    latent: torch.Tensor | None = None
    generated_len: int | None = None
    model_outputs: list[torch.Tensor] | None = None
    mtp_inputs: tuple[torch.Tensor, torch.Tensor] | None = None
    speaker: list[str] | str | None = None
    language: list[str] | str | None = None
    request_id: str | None = None
    past_key_values: list[int] | None = None
    kv_metadata: dict[str, Any] | None = None


# -- main's serializer ----------------------------------------------------------------------------------------------
_TENSOR_MARKER = "__tensor__"
_NDARRAY_MARKER = "__ndarray__"
_REQUEST_OUTPUT_KEYS = frozenset({"request_id", "prompt", "prompt_token_ids", "outputs", "finished"})
_COMPLETION_OUTPUT_KEYS = frozenset({"index", "text", "token_ids", "finish_reason"})


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        flat = obj.detach().cpu()
        if flat.dim() == 0:
            flat = flat.reshape(1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        return {
            _TENSOR_MARKER: True,
            "dtype": str(obj.dtype).removeprefix("torch."),
            "shape": list(obj.shape),
            "data": flat.view(torch.uint8).numpy().tobytes(),
        }
    if isinstance(obj, np.ndarray) and obj.dtype.kind not in ("O", "V"):
        arr = obj if obj.flags.c_contiguous else np.ascontiguousarray(obj)
        return {_NDARRAY_MARKER: True, "dtype": arr.dtype.str, "shape": list(arr.shape), "data": arr.tobytes()}
    raise TypeError(f"Object of type {type(obj).__name__} is not serializable")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_DECODER = msgspec.msgpack.Decoder()


def main_serialize(obj: Any) -> bytes:
    """Main's ``OmniSerializer.serialize``: msgpack bytes, tensors copied in as marked dicts."""
    return _ENCODER.encode(obj)


def main_deserialize(data: bytes | bytearray | memoryview) -> Any:
    """Main's ``OmniSerializer.deserialize``: Structs come back as dicts, tensors rebuilt from copies."""
    return _post_process(_DECODER.decode(data))


def _post_process(obj: Any) -> Any:
    if isinstance(obj, dict):
        if obj.get(_TENSOR_MARKER):
            data = obj["data"]
            dtype = getattr(torch, obj["dtype"])
            if not data:
                return torch.empty(obj["shape"], dtype=dtype)
            return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(obj["shape"])
        if obj.get(_NDARRAY_MARKER):
            return np.frombuffer(obj["data"], dtype=obj["dtype"]).reshape(obj["shape"])
        processed = {k: _post_process(v) for k, v in obj.items()}
        # Main tests every dict for its output types' key sets; no chunk payload matches them.
        looks_like_output = "finished" in processed and ("final_output_type" in processed or "images" in processed)
        if looks_like_output or _REQUEST_OUTPUT_KEYS.issubset(processed) or _COMPLETION_OUTPUT_KEYS.issubset(processed):
            raise TypeError("a vllm output object: not restated here")
        return processed
    if isinstance(obj, list):
        return [_post_process(item) for item in obj]
    return obj


# -- main's SharedMemoryConnector, key path -------------------------------------------------------------------------
_SHM_DIR = "/dev/shm"


def _lock_file(key: str) -> str:
    return f"{_SHM_DIR}/shm_{key}_lockfile.lock"


def _shm_write_bytes(payload: bytes, name: str) -> dict[str, Any]:
    try:
        seg = shared_memory.SharedMemory(create=True, size=len(payload), name=name)
    except FileExistsError:  # main: a re-put of a key replaces the old segment
        shared_memory.SharedMemory(name=name).unlink()
        seg = shared_memory.SharedMemory(create=True, size=len(payload), name=name)
    view = memoryview(seg.buf)  # type: ignore[arg-type]  # None only after close()
    view[: len(payload)] = payload
    del view
    meta = {"name": seg.name, "size": len(payload)}
    seg.close()
    return meta


def _shm_read_bytes(meta: dict[str, Any]) -> bytes:
    seg = shared_memory.SharedMemory(name=meta["name"])
    view = memoryview(seg.buf)  # type: ignore[arg-type]  # None only after close()
    data = bytes(view[: meta["size"]])
    del view
    seg.close()
    seg.unlink()
    return data


class MainShmConnector:
    """Main's ``SharedMemoryConnector`` restated: serialize, a new segment per put, a lock file; get copies and unlinks.

    Its config is main's ``extra`` (``stage_id`` is kept as given). ``put`` and
    ``get`` follow main's contract; a failure is logged and returned as
    ``(False, 0, None)`` / ``None``, as main does.
    """

    supports_raw_data = False

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.stage_id: Any = config.get("stage_id", -1)
        self._pending_keys: set[str] = set()
        self._metrics = {"puts": 0, "gets": 0, "bytes_transferred": 0}

    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[bool, int, dict[str, Any] | None]:
        """Serialize ``data`` into a new segment named ``put_key``, under its lock file."""
        try:
            payload = main_serialize(data)
            size = len(payload)
            with open(_lock_file(put_key), "wb+") as lockf:
                fcntl.flock(lockf, fcntl.LOCK_EX)
                meta = _shm_write_bytes(payload, put_key)
                fcntl.flock(lockf, fcntl.LOCK_UN)
            self._pending_keys.add(put_key)
            self._metrics["puts"] += 1
            self._metrics["bytes_transferred"] += size
            return True, size, {"shm": meta, "size": size}
        except Exception as exc:
            _log.error("MainShmConnector put failed for %s: %s", put_key, exc)
            return False, 0, None

    def get(self, from_stage: str, to_stage: str, get_key: str, metadata: Any = None) -> tuple[Any, int] | None:
        """The segment named ``get_key``, copied out, unlinked and deserialized; ``None`` when it is not there."""
        seg = None
        try:
            seg = shared_memory.SharedMemory(name=get_key)
            if seg.size == 0:
                return None
            result = self._read_locked(_lock_file(get_key), {"name": get_key, "size": seg.size})
            if result is not None:
                self._pending_keys.discard(get_key)
                self._metrics["gets"] += 1
            return result
        except FileNotFoundError:
            return None
        except ValueError as exc:  # the writer has not sized the segment yet: not ready
            if "empty file" not in str(exc):
                _log.debug("MainShmConnector get of %s: %s", get_key, exc)
            return None
        finally:
            if seg is not None:
                seg.close()

    def _read_locked(self, lock_file: str, handle: dict[str, Any]) -> tuple[Any, int] | None:
        done = False
        try:
            with open(lock_file, "rb+") as lockf:
                fcntl.flock(lockf, fcntl.LOCK_EX)
                data = _shm_read_bytes(handle)
                fcntl.flock(lockf, fcntl.LOCK_UN)
            obj = main_deserialize(data)
            done = True
            return obj, int(handle["size"])
        except Exception as exc:
            _log.error("MainShmConnector get failed: %s", exc)
            return None
        finally:
            if done:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(lock_file)

    def health(self) -> dict[str, Any]:
        """Main's counters."""
        return {"status": "healthy", **self._metrics}

    def close(self) -> None:
        """Unlink the segments (and lock files) of this connector's puts that nobody took."""
        for key in list(self._pending_keys):
            try:
                seg = shared_memory.SharedMemory(name=key)
                seg.close()
                seg.unlink()
            except FileNotFoundError:
                pass
            with contextlib.suppress(FileNotFoundError):
                os.remove(_lock_file(key))
        self._pending_keys.clear()

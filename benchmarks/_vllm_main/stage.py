"""One stage process of ``benchmarks/vllm_main_pipeline.py``: vllm-omni main's chunk adapter under a scheduler loop.

``python benchmarks/_vllm_main/stage.py CHECKOUT STAGE CONFIG_JSON RECORDS_PATH``

The process loads main's modules from ``CHECKOUT`` (``env.py``),
registers zmq_omni's connectors in main's ``OmniConnectorFactory``, and
builds main's ``OmniChunkTransferAdapter`` from the stage's
``stage_connector_config`` (``CONFIG_JSON``) with the stage's
``custom_process_next_stage_input_func`` (main's ``thinker2talker_async_chunk``
for stage 0, ``talker2code2wav_async_chunk`` for stage 1). The adapter's own
receive and save threads move the chunks; this process plays vLLM's
scheduler and model around them:

- **the scheduler loop** (re-stated from main's ``OmniARScheduler`` /
  ``OmniGenerationScheduler``): each step calls ``process_pending_chunks``,
  schedules the requests whose chunk is ready, calls ``restore_queues`` and
  ``postprocess_scheduler_output``, then runs the "model" on what it
  scheduled and hands each model output to ``save_async``. A step that
  scheduled nothing waits 1 ms (the harness's choice; an engine that
  busy-stepped would take a core of the two).
- **the models** are stand-ins producing what the issue states: the thinker
  (stage 0) emits, per request, a prefill output (layers 0 and 24 of
  ``[P, 2048]`` bf16 and ``tts_bos/eos/pad`` ``[1, 1, 2048]``), then one
  ``[1, 2048]`` decode output per step, so main's processor sends chunk 0
  (``embed.prefill`` and ``hidden_states.output`` of ``[P+1, 2048]``) at
  step 1 and a ``[1, 2048]`` ``embed.decode`` chunk at each later step; the
  talker (stage 1) turns thinker chunk ``k`` into 4 codec frames (``k = 0``)
  or 25 (``k > 0``) of ``[1, 16]`` int64, one ``save_async`` per frame, so
  main's processor, with the YAML's ``initial_codec_chunk_frames: 4`` and
  ``codec_chunk_frames: 25``, sends exactly one code2wav chunk per thinker
  chunk (64, 464, then 800 codes with ``meta.left_context_size`` 0, 4, 25);
  code2wav (stage 2) checks them.
- **checks**: the talker compares every tensor and id list of every thinker
  chunk with what the thinker made; code2wav compares every codec chunk's
  codes (what main's adapter turns them into: the request's
  ``prompt_token_ids``) and ``left_context_size``.

Commands arrive on stdin, one a line: ``add RID ORDINAL CHUNKS PACE_S`` (a
request; the orchestrator sends it to stages 2, 1, 0 in that order) and
``finish`` (and ``cpu LABEL``, below). Events go to stdout as lines starting ``@@``: ``@@ready``,
``@@done RID`` (code2wav has every chunk of RID), ``@@records PATH``.
Anything else on stdout/stderr is log, shown by the harness on failure.

Timing: the connector's ``put`` and ``get`` are wrapped (``timing.Timed``) to record,
with ``time.monotonic()`` (system-wide on Linux, so comparable between the
processes), when each put started and ended, when each get that returned a
chunk started and ended, and how long each miss took; the thinker records
when it called ``save_async`` for each step. The talker's last frame of a
request finishes it (``is_finished``, and ``is_segment_finished`` as main's
AR scheduler passes it); code2wav calls the adapter's ``cleanup`` at a
request's end, as main's generation scheduler does.

CPU: a ``cpu LABEL`` line on stdin (answered by the command thread at once)
records, under ``cpu.LABEL``, the CPU seconds each live thread has spent
(``/proc/self/task``, clock ticks), the process's own (``(process)``) and
the CPU seconds the calling threads spent inside ``put``, ``get`` hits and
``get`` misses (``time.thread_time`` around each call).
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
import traceback
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _vllm_main import env as main_env
from _vllm_main.timing import Timed, cpu_by_thread

HIDDEN = 2048
CODEBOOKS = 16
PROCESSORS = "vllm_omni.model_executor.stage_input_processors.qwen3_omni"
IDLE_STEP_S = 0.001


# ---------------------------------------------------------------- the data each stage makes and checks


def _pattern(rows: int, ordinal: int, step: int, layer: int) -> Any:
    """A ``[rows, 2048]`` bf16 tensor that says which request, step and layer it is."""
    import torch

    base = _BASE.get(rows)
    if base is None:
        gen = torch.Generator().manual_seed(rows)
        base = _BASE[rows] = torch.randn(rows, HIDDEN, generator=gen).to(torch.bfloat16)
    out = base.clone()
    out[:, 0] = ordinal % 256
    out[:, 1] = step % 256
    out[:, 2] = layer
    return out


_BASE: dict[int, Any] = {}


def _tts(ordinal: int, which: int) -> Any:
    import torch

    return torch.full((1, 1, HIDDEN), float(which), dtype=torch.bfloat16) + ordinal % 64


def thinker_output(ordinal: int, step: int, prompt_len: int) -> dict[str, Any]:
    """The thinker's model output of one step, flattened as main's model runner hands it to ``save_async``."""
    rows = prompt_len if step == 0 else 1
    out: dict[str, Any] = {
        "hidden_states.layer_0": _pattern(rows, ordinal, step, 0),
        "hidden_states.layer_24": _pattern(rows, ordinal, step, 24),
    }
    if step <= 1:
        for which, name in enumerate(("tts_bos", "tts_eos", "tts_pad")):
            out[f"embed.{name}"] = _tts(ordinal, which)
    return out


_FRAMES: dict[int, Any] = {}


def frames(ordinal: int, count: int) -> Any:
    """The first ``count`` codec frames of a request, ``[count, 16]`` int64, never 0 (main skips all-zero frames).

    Made once per request (again, twice as long, when a request outgrows it) and
    sliced, so the stand-in model and the checks cost the stages little next to
    what is measured.
    """
    import torch

    made = _FRAMES.get(ordinal)
    if made is None or made.shape[0] < count:
        index = torch.arange(max(count, 1024, 0 if made is None else 2 * made.shape[0]), dtype=torch.int64).unsqueeze(1)
        start = (ordinal * 7919 + index * CODEBOOKS) % 2000
        made = _FRAMES[ordinal] = (start + torch.arange(CODEBOOKS, dtype=torch.int64)) % 2047 + 1
    return made[:count]


def frames_of_chunk(chunk: int) -> int:
    """Frames the talker makes from thinker chunk ``chunk`` (the YAML's initial and regular codec chunk sizes)."""
    return 4 if chunk == 0 else 25


def expected_codec(ordinal: int, chunk: int) -> tuple[list[int], int]:
    """The codes and ``left_context_size`` main's ``talker2code2wav_async_chunk`` sends as code2wav chunk ``chunk``."""
    total = 4 + 25 * chunk
    first, left = (0, 0) if chunk == 0 else (0, 4) if chunk == 1 else (total - 50, 25)
    codes: list[int] = frames(ordinal, total)[first:].transpose(0, 1).reshape(-1).tolist()
    return codes, left


# ---------------------------------------------------------------- vLLM's request and queue, as main's adapter uses them


class Request:
    """The fields of vLLM's ``Request`` that main's chunk adapter and Qwen3-Omni processors read or write."""

    def __init__(self, rid: str, ordinal: int, chunks: int, pace_s: float, prompt_len: int) -> None:
        status = sys.modules["vllm.v1.request"].RequestStatus
        self.request_id = rid
        self.external_req_id = rid
        self.ordinal = ordinal
        self.chunks = chunks
        self.pace_s = pace_s
        self.status = status.WAITING
        self.additional_information: Any = None
        self.resumable = False
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.prompt_token_ids: list[int] = list(range(prompt_len))
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.sampling_params = None
        self.step = 0
        self.next_step_at = 0.0

    def is_finished(self) -> bool:
        return bool(sys.modules["vllm.v1.request"].RequestStatus.is_finished(self.status))


class RequestQueue(deque[Request]):
    """vLLM's FCFS waiting queue: the methods main's chunk adapter calls."""

    def add_request(self, request: Request) -> None:
        self.append(request)

    def prepend_requests(self, requests: list[Request]) -> None:
        self.extendleft(reversed(requests))


# ---------------------------------------------------------------- the stage


class Stage:
    """One stage process: main's adapter, a scheduler loop, the model stand-in, the checks."""

    def __init__(self, stage_id: int, config: dict[str, Any]) -> None:
        from vllm_omni.distributed.omni_connectors.transfer_adapter.chunk_transfer_adapter import (  # type: ignore[import-not-found]
            OmniChunkTransferAdapter,
        )

        self.stage_id = stage_id
        self.prompt_len = int(config["prompt_len"])
        self.records: dict[str, Any] = {"saves": {}, "problems": []}
        self.problems: list[str] = self.records["problems"]
        processor = {0: "thinker2talker_async_chunk", 1: "talker2code2wav_async_chunk"}.get(stage_id)
        model_config = SimpleNamespace(
            stage_id=stage_id,
            stage_connector_config=config["stage_connector_config"],
            worker_type="generation" if stage_id == 2 else "ar",
            custom_process_next_stage_input_func=f"{PROCESSORS}.{processor}" if processor else None,
            max_num_seqs=64,
            active_stream_window=0,
        )
        vllm_config = SimpleNamespace(model_config=model_config, scheduler_config=SimpleNamespace(max_num_seqs=64))
        self.adapter = OmniChunkTransferAdapter(vllm_config)
        self.connector = self.adapter.connector
        self.timed = Timed(self.connector, self.records)
        self.adapter.connector = self.timed
        self.waiting = RequestQueue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.commands: queue.Queue[str] = queue.Queue()
        self.finishing = False
        status = sys.modules["vllm.v1.request"].RequestStatus
        self.status = status

    # the orchestrator's commands, on stdin
    def read_commands(self) -> None:
        for line in sys.stdin:
            if line.startswith("cpu "):  # answered here, not by the scheduler loop, so the snapshot is on time
                self.records.setdefault("cpu", {})[line.split()[1]] = {**cpu_by_thread(), **self.timed.calls_cpu}
                continue
            self.commands.put(line.strip())
        self.commands.put("finish")

    def _take_commands(self, block: bool) -> None:
        while True:
            try:
                line = self.commands.get(timeout=0.1) if block else self.commands.get_nowait()
            except queue.Empty:
                return
            block = False
            words = line.split()
            if not words:
                continue
            if words[0] == "finish":
                self.finishing = True
                return
            _, rid, ordinal, chunks, pace_s = words
            request = Request(rid, int(ordinal), int(chunks), float(pace_s), self.prompt_len)
            request.next_step_at = time.monotonic()
            self.requests[rid] = request
            self.waiting.add_request(request)

    def run(self) -> None:
        """The scheduler loop until ``finish``."""
        threading.Thread(target=self.read_commands, daemon=True, name="commands").start()
        print("@@ready", flush=True)
        while not self.finishing:
            self._take_commands(block=not self.requests)
            if self.finishing:
                break
            if not self.requests:
                continue
            did = self._step_thinker() if self.stage_id == 0 else self._step_receiver()
            if not did:
                time.sleep(IDLE_STEP_S)

    # stage 0
    def _step_thinker(self) -> bool:
        now = time.monotonic()
        due = [r for r in list(self.waiting) + self.running if r.next_step_at <= now]
        for request in due:
            if request in self.waiting:
                self.waiting.remove(request)
                self.running.append(request)
                request.status = self.status.RUNNING
            step = request.step
            output = thinker_output(request.ordinal, step, self.prompt_len)
            request.num_computed_tokens = self.prompt_len + step
            if step > 0:
                request.all_token_ids.append(1000 + step)
            last = step == request.chunks  # step k + 1 completes chunk k
            if last:
                request.status = self.status.FINISHED_STOPPED
            self.records["saves"][f"{request.request_id}_{step}"] = time.monotonic()
            self.adapter.save_async(output, request, last)
            request.step += 1
            request.next_step_at += request.pace_s
            if last:
                self.running.remove(request)
                del self.requests[request.request_id]
        return bool(due)

    # stages 1 and 2
    def _step_receiver(self) -> bool:
        adapter = self.adapter
        adapter.process_pending_chunks(self.waiting, self.running, scheduler_requests=self.requests)
        scheduled = [
            r
            for r in list(self.waiting) + self.running
            if r.status != self.status.WAITING_FOR_CHUNK and r.request_id in adapter.requests_with_ready_chunks
        ]
        adapter.restore_queues(self.waiting, self.running, scheduler_requests=self.requests)
        inputs = {r.request_id: (r.additional_information, list(r.prompt_token_ids)) for r in scheduled}
        new = [r for r in scheduled if r in self.waiting]
        for request in new:
            self.waiting.remove(request)
            self.running.append(request)
            request.status = self.status.RUNNING
        output = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id) for r in new],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[r.request_id for r in scheduled if r not in new]),
        )
        if self.stage_id == 1:
            adapter.postprocess_scheduler_output(output, self.requests)
        else:
            adapter.postprocess_scheduler_output(output)
        for request in scheduled:
            info, prompt_ids = inputs[request.request_id]
            if self.stage_id == 1:
                self._talk(request, info)
            else:
                self._decode(request, info, prompt_ids)
        return bool(scheduled)

    def _chunk_index(self, request: Request) -> int:
        return int(self.adapter.get_req_chunk[request.request_id]) - 1

    def _finish(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        self.requests.pop(request.request_id, None)

    def _talk(self, request: Request, payload: Any) -> None:
        chunk = self._chunk_index(request)
        self._check_thinker_chunk(request, chunk, payload)
        finished = request.request_id in self.adapter.finished_requests
        count = frames_of_chunk(chunk)
        base = 0 if chunk == 0 else 4 + 25 * (chunk - 1)
        made = frames(request.ordinal, base + count)
        for i in range(count):
            last = finished and i == count - 1
            if last:
                request.status = self.status.FINISHED_STOPPED
            request.num_computed_tokens += 1
            # one talker step, one [1, 16] frame: what main's model runner hands save_async
            self.adapter.save_async({"codes.audio": made[base + i : base + i + 1]}, request, last)
        if finished:
            if chunk != request.chunks - 1:
                self.problems.append(f"{request.request_id}: finished at thinker chunk {chunk}")
            self._finish(request)

    def _check_thinker_chunk(self, request: Request, chunk: int, payload: Any) -> None:
        import torch

        r, where = request.ordinal, f"{request.request_id} thinker chunk {chunk}"
        try:
            embed = payload["embed"]
            if chunk == 0:
                p = self.prompt_len
                want_emb = torch.cat((_pattern(p, r, 0, 0), _pattern(1, r, 1, 0)))
                want_hid = torch.cat((_pattern(p, r, 0, 24), _pattern(1, r, 1, 24)))
                got = {"embed.prefill": embed["prefill"], "hidden_states.output": payload["hidden_states"]["output"]}
                want = {"embed.prefill": want_emb, "hidden_states.output": want_hid}
                for which, name in enumerate(("tts_bos", "tts_eos", "tts_pad")):
                    got[f"embed.{name}"] = embed[name]
                    want[f"embed.{name}"] = _tts(r, which)
                ids = payload["ids"]
                # the save thread reads all_token_ids when it builds the payload: later tokens may be there too
                if ids["prompt"] != list(range(p)) or ids["all"][: p + 1] != [*range(p), 1001]:
                    self.problems.append(f"{where}: ids {str(ids)[:200]}")
            else:
                got = {"embed.decode": embed["decode"]}
                want = {"embed.decode": _pattern(1, r, chunk + 1, 0)}
            for name, tensor in want.items():
                value = got[name]
                if not (isinstance(value, torch.Tensor) and value.dtype == tensor.dtype and torch.equal(value, tensor)):
                    self.problems.append(f"{where}: {name} differs ({getattr(value, 'shape', type(value))})")
            last = bool(payload["meta"]["finished"].item())
            if last != (chunk == request.chunks - 1):
                self.problems.append(f"{where}: meta.finished {last}")
        except (KeyError, TypeError, AttributeError) as exc:
            self.problems.append(f"{where}: {exc!r} in {str(payload)[:300]}")

    def _decode(self, request: Request, info: Any, codes: list[int]) -> None:
        chunk = self._chunk_index(request)
        where = f"{request.request_id} codec chunk {chunk}"
        want, left = expected_codec(request.ordinal, chunk)
        if codes != want:
            self.problems.append(f"{where}: {len(codes)} codes, not the {len(want)} the talker made")
        got_left = (info or {}).get("meta", {}).get("left_context_size")
        if got_left != left:
            self.problems.append(f"{where}: left_context_size {got_left}, want {left}")
        if request.request_id in self.adapter.finished_requests:
            if chunk != request.chunks - 1:
                self.problems.append(f"{request.request_id}: finished at codec chunk {chunk}")
            self.adapter.cleanup(request.request_id, request.external_req_id)
            self._finish(request)
            print(f"@@done {request.request_id}", flush=True)

    def close(self, records_path: Path) -> None:
        self.adapter.shutdown()
        # main's shutdown() does not join its threads; the process must not exit under them
        for thread in (self.adapter.recv_thread, self.adapter.save_thread):
            thread.join(timeout=5.0)
            if thread.is_alive():
                self.problems.append(f"main's adapter thread {thread.name} still runs 5 s after shutdown()")
        self.records["health"] = self.connector.health()
        records_path.write_text(json.dumps(self.records))
        print(f"@@records {records_path}", flush=True)


def main(argv: list[str]) -> int:
    """Run one stage; exit 0 only when every check passed."""
    checkout, stage_id, config_json, records_path = argv
    main_env.install(Path(checkout))
    import torch

    torch.set_num_threads(1)  # three stage processes share the host's cores; no intra-op thread pools
    import zmq_omni.connectors.vllm_plugin as plugin

    plugin.register()
    config = json.loads(config_json)
    stage = Stage(int(stage_id), config)
    print(
        f"stage {stage_id}: {type(stage.connector).__name__} from {config['stage_connector_config']}"
        f" (zmq_omni from {Path(plugin.__file__).parents[1]})",
        flush=True,
    )
    try:
        stage.run()
    except Exception:
        stage.problems.append(traceback.format_exc())
    stage.close(Path(records_path))
    for problem in stage.problems[:20]:
        print(f"stage {stage_id}: PROBLEM {problem}", flush=True)
    return 1 if stage.problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

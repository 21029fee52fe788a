"""One stage process of the qwen3_omni_moe-shaped pipeline: thinker (0) -> talker (1) -> code2wav (2).

``python -m tests.vllm_main.stage_proc STAGE CONFIG_JSON WORKDIR REQUESTS CHUNKS``

The process builds the scheduler's chunk adapter and the model runner's
connector mixin from one ``stage_connector_config`` (the same dict object, as
main's ``model_config`` hands both), and splits the requests between them:
request ``i`` is received by one and sent by the other, crosswise per stage.

- stage 0 sends ``CHUNKS`` thinker chunks per request (msgspec Structs, as
  main's adapter puts ``OmniPayloadStruct``); it holds back the last chunk of
  every request until stage 2 has written ``WORKDIR/streamed`` (every other
  chunk already arrived there), so the test shows chunks stream through the
  middle stage before the end of the stream;
- stage 1 turns each thinker chunk into a codec chunk as it arrives and sends
  it on with its ``role: receiver`` connector;
- stage 2 checks every codec chunk, writes ``streamed``, then ``result.json``.

Every stage runs until its stdin closes (the test closes it once
``result.json`` exists, or on timeout), prints what went wrong, closes its
connectors and exits 0 only when nothing went wrong.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import torch

from tests.vllm_main.stand_ins import RunnerConnectorMixin, SchedulerChunkAdapter, is_finished

DEADLINE_S = 60.0


class MetaStruct(msgspec.Struct, omit_defaults=True, kw_only=True):
    """The fields of main's ``MetaStruct`` that this pipeline uses."""

    finished: Any = None
    chunk_seq: int | None = None


class PayloadStruct(msgspec.Struct, omit_defaults=True, kw_only=True):
    """The shape of main's ``OmniPayloadStruct``: nested dicts of tensors plus ``meta``."""

    hidden_states: dict[str, Any] | None = None
    ids: dict[str, Any] | None = None
    meta: MetaStruct | None = None


def thinker_chunk(index: int, chunk: int, last: bool) -> PayloadStruct:
    """Chunk ``chunk`` of request number ``index`` from the thinker."""
    return PayloadStruct(
        hidden_states={"output": torch.full((2, 8), float(chunk), dtype=torch.float32) + index},
        ids={"output": [index, chunk]},
        meta=MetaStruct(finished=torch.tensor(last, dtype=torch.bool), chunk_seq=chunk),
    )


def expected_codes(index: int, chunk: int) -> torch.Tensor:
    """The codec codes stage 2 must receive for ``(index, chunk)``."""
    return (torch.arange(8, dtype=torch.int64) + 100 * chunk + 10_000 * index).reshape(1, 8)


def talker_chunk(payload: dict[str, Any]) -> dict[str, Any]:
    """Stage 1's work on one received thinker chunk: the codec chunk for stage 2 (main's talker->code2wav shape)."""
    index, chunk = payload["ids"]["output"]
    return {"codes": {"audio": expected_codes(index, chunk)}, "meta": {"finished": payload["meta"]["finished"]}}


class Stage:
    """The stage's two chunk movers and what it saw."""

    def __init__(self, stage_id: int, config: dict[str, Any], workdir: Path, requests: list[str], chunks: int) -> None:
        self.stage_id = stage_id
        self.workdir = workdir
        self.requests = requests
        self.chunks = chunks
        self.problems: list[str] = []
        self.received: dict[str, list[int]] = {r: [] for r in requests}
        self.done = threading.Event()
        self.streamed = threading.Event()
        self._lock = threading.Lock()
        given_extra = json.loads(json.dumps(config["extra"]))
        # one spec, one dict object, two connectors in this process (main: scheduler + model runner)
        self.adapter = SchedulerChunkAdapter(config, self.on_chunk)
        self.mixin = RunnerConnectorMixin(config, stage_id, self.on_chunk)
        if config["extra"] != given_extra:
            self.problems.append(f"the constructors changed the shared extra: {config['extra']}")

    def receiver_of(self, index: int) -> str:
        return "mixin" if (index + self.stage_id) % 2 == 0 else "adapter"

    def send(self, index: int, payload: Any) -> None:
        request = self.requests[index]
        if self.receiver_of(index) == "mixin":  # crosswise: the other one sends
            self.adapter.save_async(request, payload)
        else:
            self.mixin.send_chunk(request, payload)

    def on_chunk(self, request_id: str, chunk_id: int, payload: Any) -> None:
        index = self.requests.index(request_id)
        with self._lock:
            self.received[request_id].append(chunk_id)
            seen = list(self.received[request_id])
        if seen != list(range(len(seen))):
            self.problems.append(f"{request_id}: chunks out of order {seen}")
        last = is_finished(payload)
        if last != (chunk_id == self.chunks - 1):
            self.problems.append(f"{request_id}: chunk {chunk_id} has finished={last}")
        if self.stage_id == 1:
            if payload["ids"]["output"] != [index, chunk_id]:
                self.problems.append(f"{request_id}: chunk {chunk_id} carries {payload['ids']['output']}")
            self.send(index, talker_chunk(payload))
        elif self.stage_id == 2:
            codes = payload["codes"]["audio"]
            if not (isinstance(codes, torch.Tensor) and torch.equal(codes, expected_codes(index, chunk_id))):
                self.problems.append(f"{request_id}: chunk {chunk_id} codes {codes!r}")
            self._check_progress()

    def _check_progress(self) -> None:
        # The adapter's and the mixin's receive threads both get here, and can see the last chunk at once:
        # which of them writes each file is decided under the lock, so each is written by one thread, once.
        with self._lock:
            counts = [len(v) for v in self.received.values()]
            stream_now = all(c >= self.chunks - 1 for c in counts) and not self.streamed.is_set()
            finish_now = all(c == self.chunks for c in counts) and not self.done.is_set()
            if stream_now:
                self.streamed.set()
            if finish_now:
                self.done.set()
            result = json.dumps({"received": self.received, "problems": self.problems}) if finish_now else ""
        if stream_now:
            (self.workdir / "streamed").touch()
        if finish_now:
            tmp = self.workdir / "result.json.tmp"
            tmp.write_text(result)
            tmp.rename(self.workdir / "result.json")

    def start(self) -> None:
        for index, request in enumerate(self.requests):
            if self.stage_id == 0:
                continue
            if self.receiver_of(index) == "mixin":
                self.mixin.register_chunk_recv(request, request)
            else:
                self.adapter.load_async(request, request)
        if self.stage_id == 0:
            threading.Thread(target=self._produce, daemon=True, name="thinker").start()

    def _produce(self) -> None:
        for chunk in range(self.chunks - 1):
            for index in range(len(self.requests)):
                self.send(index, thinker_chunk(index, chunk, last=False))
        deadline = time.monotonic() + DEADLINE_S
        while not (self.workdir / "streamed").exists():
            if time.monotonic() > deadline:
                self.problems.append("stage 2 never reported the streamed chunks")
                return
            time.sleep(0.01)
        for index in range(len(self.requests)):
            self.send(index, thinker_chunk(index, self.chunks - 1, last=True))

    def finish(self) -> int:
        idle_by = time.monotonic() + 10
        while not (self.adapter.idle() and self.mixin.idle()) and time.monotonic() < idle_by:
            time.sleep(0.01)
        for name, mover in (("adapter", self.adapter), ("mixin", self.mixin)):
            if mover.failed_puts:
                self.problems.append(f"{name}: puts that failed: {mover.failed_puts}")
            if mover.errors:
                self.problems.append(f"{name}: errors: {mover.errors[:10]}")
        health = {"adapter": self.adapter.connector.health(), "mixin": self.mixin.connector.health()}
        # both connectors of the process did their share: stage 0 sends, 2 receives, 1 both
        wanted = {0: ("puts",), 1: ("puts", "gets"), 2: ("gets",)}[self.stage_id]
        for name, counters in health.items():
            for counter in wanted:
                if not counters.get(counter):
                    self.problems.append(f"{name}'s connector did no {counter}: {counters}")
        self.adapter.shutdown()
        self.mixin.shutdown()
        print(f"stage {self.stage_id}: received {self.received}", flush=True)
        print(f"stage {self.stage_id}: health {health}", flush=True)
        for problem in self.problems:
            print(f"stage {self.stage_id}: PROBLEM {problem}", flush=True)
        return 1 if self.problems else 0


def main(argv: list[str]) -> int:
    """Run one stage until stdin closes."""
    stage_id, config_json, workdir, requests, chunks = argv
    config = json.loads(config_json)
    stage = Stage(int(stage_id), config, Path(workdir), requests.split(","), int(chunks))
    print(f"stage {stage_id}: up, connector config {config}", flush=True)
    stage.start()
    sys.stdin.read()  # the test closes stdin when it is done with us
    return stage.finish()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

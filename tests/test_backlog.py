"""A stage that falls behind its upstream (issue 13, item 3: the long compose run).

Through ``docker-compose.yml`` on a loaded machine, 4 requests x 6,000 chunks x
256 KiB made the talker grow to gigabytes and every request fail with "no chunk
from stage 1": the chunk manager's receive worker read every chunk the thinker
sent into the request's untaken backlog whatever the worker's pace, so the
thinker's window never pushed back, each worker pass assembled an ever larger
backlog, and the gaps between the talker's outputs grew past the vocoder's
stall timeout. The backlog is now bounded (``max_ready_chunks``,
``max_ready_bytes``): what is not taken stays in the connector, unconsumed,
so the sender's window holds the upstream back; the pause does not count as an
upstream stall. The talker also counted as completed requests whose last chunks
were never delivered; a worker now counts one completed only once its final
chunk is put, and recounts it failed on a later send failure.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from zmq_omni import StageWorker
from zmq_omni.adapters import ChunkInputs, ChunkManagerConfig, OmniChunkManager
from zmq_omni.connectors import OmniConnectorBase
from zmq_omni.connectors.inproc import InProcConnector
from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.stages import PipelineDriver

from .adapter_helpers import FAST_RETRY, FlakyConnector
from .zmq_peers import expect, spawned

CHUNKS = 400
CHUNK_BYTES = 64 << 10
READY_BOUND = 64  # ChunkManagerConfig's default max_ready_chunks


def stream_main(endpoint: str, chunks: int, out: Any) -> None:
    """Stage 0 in its own process: stream ``chunks`` chunks of ``CHUNK_BYTES`` to stage 1, then report."""
    config = {
        "stage_id": "0",
        "role": "sender",
        "endpoints": {"1": endpoint},
        "shm": "off",
        # A window far larger than the receiver's backlog bound: the bound, not the window, is under test.
        "max_unacked": 10_000,
        "put_timeout_s": 30.0,
        "delivery_timeout_s": 60.0,
    }
    with (
        ZmqConnector(config) as conn,
        OmniChunkManager(ChunkManagerConfig(stage_id="0", downstream_stage_id="1", retry=FAST_RETRY), conn) as sender,
    ):
        for index in range(chunks):
            payload = {"x": np.full(CHUNK_BYTES // 8, index, dtype=np.int64), "index": index}
            sender.save_async("r", payload, is_final=index == chunks - 1)
        deadline = time.monotonic() + 60
        finished = failed = False
        while not (finished or failed) and time.monotonic() < deadline:
            finished = "r" in sender.get_finished_requests().saved
            failed = bool(sender.collect_failed_send_request_ids())
            time.sleep(0.02)
        out.put(("done", finished, failed, conn.flush(30.0)))


def _take_all(manager: OmniChunkManager, request_id: str, timeout_s: float) -> list[ChunkInputs]:
    taken: list[ChunkInputs] = []
    deadline = time.monotonic() + timeout_s
    while not (taken and taken[-1].is_final):
        assert time.monotonic() < deadline, f"stream unfinished: {sum(t.num_chunks for t in taken)} chunks taken"
        assert not manager.collect_failed_receive_request_ids()
        inputs = manager.take_inputs(request_id)
        if inputs is None:
            manager.wait_for_progress(0.05)
        else:
            taken.append(inputs)
    return taken


def test_a_stage_that_stops_taking_holds_a_bounded_backlog_and_then_gets_the_whole_stream() -> None:
    stall_s = 1.0
    with (
        ZmqConnector(
            {"stage_id": "1", "role": "receiver", "endpoints": {"1": "tcp://127.0.0.1:0"}, "shm": "off"}
        ) as conn,
        OmniChunkManager(
            ChunkManagerConfig(stage_id="1", upstream_stage_id="0", stall_timeout_s=stall_s),
            conn,
        ) as receiver,
    ):
        assert conn.endpoint is not None
        with spawned(stream_main, conn.endpoint, CHUNKS) as (_, queue):
            # The request is loaded once its stream comes in: the sender's process may take longer than the
            # stall timeout to start on a loaded machine, and that wait is not an upstream stall.
            deadline = time.monotonic() + 60
            while conn.health()["mailbox"] == 0:
                assert time.monotonic() < deadline, f"nothing ever waited in the connector: {conn.health()}"
                time.sleep(0.05)
            # The scheduler falls behind: nothing is taken, for well over the stall timeout.
            receiver.load_async("r")
            time.sleep(2.5 * stall_s)
            health = receiver.health()
            assert receiver.collect_failed_receive_request_ids() == {}, "a paused read counted as an upstream stall"
            # The rest waits in the connector, unconsumed: the sender's window is what holds the upstream back.
            assert health["connector"]["mailbox"] > 0, health
            taken = _take_all(receiver, "r", timeout_s=60)
            finished, failed, flushed = expect(queue, "done", timeout=60)
        assert (finished, failed, flushed) == (True, False, True)
    # Before the bound, the first take after the pause assembled the whole stream read so far.
    assert taken[0].num_chunks <= READY_BOUND, [t.num_chunks for t in taken[:3]]
    indexes = np.concatenate([np.asarray(t.data["x"]).reshape(-1, CHUNK_BYTES // 8)[:, 0] for t in taken])
    assert indexes.tolist() == list(range(CHUNKS))  # nothing lost, repeated or reordered
    assert health["ready_chunks"] <= READY_BOUND == ChunkManagerConfig(stage_id="1").max_ready_chunks, health


def test_the_byte_bound_holds_across_requests_and_each_request_still_progresses() -> None:
    namespace = f"backlog-{uuid.uuid4().hex}"
    chunk = {"x": np.zeros(CHUNK_BYTES, dtype=np.uint8)}
    with (
        InProcConnector({"namespace": namespace, "stage_id": "0"}) as conn0,
        InProcConnector({"namespace": namespace, "stage_id": "1"}) as conn1,
        OmniChunkManager(ChunkManagerConfig(stage_id="0", retry=FAST_RETRY), conn0) as sender,
        OmniChunkManager(
            ChunkManagerConfig(stage_id="1", stall_timeout_s=1.0, max_ready_bytes=3 * CHUNK_BYTES), conn1
        ) as receiver,
    ):
        requests = ["a", "b", "c", "d"]
        for request_id in requests:
            receiver.load_async(request_id)
        for index in range(20):
            for request_id in requests:
                sender.save_async(request_id, chunk, is_final=index == 19)
        time.sleep(2.0)  # nothing taken: longer than the stall timeout
        health = receiver.health()
        assert receiver.collect_failed_receive_request_ids() == {}
        # Each request may read one chunk while others hold the bytes, so none is starved.
        assert 0 < health["ready_bytes"] <= 3 * CHUNK_BYTES + len(requests) * CHUNK_BYTES, health
        totals = {request_id: sum(t.num_chunks for t in _take_all(receiver, request_id, 30)) for request_id in requests}
        assert totals == dict.fromkeys(requests, 20)
        assert receiver.health()["ready_bytes"] == 0


def echo(request_id: str, payload: dict[str, Any], is_final: bool) -> dict[str, Any]:
    return {"y": np.ones(4)}


def echo_worker(namespace: str, outbound: OmniConnectorBase, *, downstream: str) -> StageWorker:
    """Stage "1" running ``echo``, fed by the driver in ``namespace``, sending through ``outbound``; started."""
    worker = StageWorker(
        echo,
        stage_id="1",
        upstream_stage_id="driver",
        downstream_stage_id=downstream,
        inbound=InProcConnector({"namespace": namespace, "stage_id": "1"}),
        outbound=outbound,
        stall_timeout_s=2.0,
        retry=FAST_RETRY,
    )
    worker.start()
    return worker


def inproc_driver(namespace: str, *, last_stage_id: str) -> PipelineDriver:
    """A driver of stage "1" in ``namespace`` that hears back from ``last_stage_id``."""
    return PipelineDriver(
        first_stage_id="1",
        last_stage_id=last_stage_id,
        inbound={"name": "InProcConnector", "extra": {"namespace": namespace}},
        outbound={"name": "InProcConnector", "extra": {"namespace": namespace}},
        stall_timeout_s=2.0,
        request_timeout_s=10.0,
    )


def test_a_request_whose_final_chunk_is_never_delivered_counts_as_failed_not_completed() -> None:
    namespace = f"count-{uuid.uuid4().hex}"
    outbound = FlakyConnector({"namespace": namespace, "stage_id": "1"})
    # The final chunk "goes out" (the put returns True), then the connector reports it undelivered,
    # as a push connector does for a put the next stage never confirmed.
    outbound.lost.add("lost_1_0")
    worker = echo_worker(namespace, outbound, downstream="driver")
    try:
        with inproc_driver(namespace, last_stage_id="1") as driver:
            driver.submit("ok", {"n": 1})
            driver.submit("lost", {"n": 1})
            outcome: dict[str, str] = {}
            deadline = time.monotonic() + 20
            while len(outcome) < 2:
                assert time.monotonic() < deadline, outcome
                for event in driver.poll(0.05):
                    if event.kind != "chunk":
                        outcome[event.request_id] = event.kind
            assert outcome == {"ok": "completed", "lost": "failed"}
            deadline = time.monotonic() + 10
            while worker.stats["failed"] < 1:  # the undelivered put is booked on the worker's next pass
                assert time.monotonic() < deadline, worker.stats
                time.sleep(0.02)
    finally:
        worker.close()
    assert (worker.stats["completed"], worker.stats["failed"]) == (1, 1), worker.stats


def test_a_request_whose_final_chunk_the_next_stage_dropped_as_cancelled_counts_as_failed(short_tmp: Path) -> None:
    namespace = f"drop-{uuid.uuid4().hex}"
    endpoint = f"ipc://{short_tmp}/vocoder.sock"
    common = {"endpoints": {"2": endpoint}, "shm": "off", "heartbeat_s": 0.05}
    with (
        ZmqConnector({"stage_id": "2", "role": "receiver", **common}) as vocoder,
        ZmqConnector({"stage_id": "1", "role": "sender", **common}) as outbound,
    ):
        assert vocoder.get("1", "2", "warm") is None  # binds
        # The next stage gave the request up before its final chunk came: that chunk is dropped on arrival.
        vocoder.cleanup_prefix("gone_1_")
        worker = echo_worker(namespace, outbound, downstream="2")
        try:
            with inproc_driver(namespace, last_stage_id="2") as driver:
                driver.submit("kept", {"n": 1})
                driver.submit("gone", {"n": 1})
                deadline = time.monotonic() + 20
                while worker.stats["completed"] + worker.stats["failed"] < 2 or worker.stats["failed"] < 1:
                    assert time.monotonic() < deadline, worker.stats
                    time.sleep(0.02)
                got = vocoder.get_with_deadline("1", "2", "kept_1_0", None, deadline=time.monotonic() + 5)
                assert got is not None and got[0]["meta"]["final"]
        finally:
            worker.close()
    assert (worker.stats["completed"], worker.stats["failed"]) == (1, 1), worker.stats
    assert outbound.health()["receiver_dropped_cancelled"] == 1

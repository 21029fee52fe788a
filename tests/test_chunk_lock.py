"""No connector call runs under the chunk manager's lock: every call it makes is checked where it lands.

The manager decides under its lock and does the I/O after releasing it; a
connector call under the lock (``cleanup_prefix`` lists a directory and renames
files on the shared-memory connector) would stall every scheduler call behind it.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from typing import Any

import numpy as np

from tests.adapter_helpers import FAST_RETRY, FlakyConnector
from zmq_omni.adapters import ChunkManagerConfig, OmniChunkManager
from zmq_omni.connectors import TransferFailure


class LockCheckingConnector(FlakyConnector):
    """A FlakyConnector that notes each call made while its manager's lock is held by the caller."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.manager: OmniChunkManager | None = None
        self.calls: Counter[str] = Counter()
        self.under_lock: list[str] = []
        self._book = threading.Lock()

    def _check(self, name: str) -> None:
        manager = self.manager
        held = manager is not None and manager._lock._is_owned()  # type: ignore[attr-defined]
        with self._book:
            self.calls[name] += 1
            if held:
                self.under_lock.append(f"{name} on {threading.current_thread().name}")

    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[bool, int, dict[str, Any] | None]:
        self._check("put")
        return super().put(from_stage, to_stage, put_key, data)

    def get(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict[str, Any] | None = None
    ) -> tuple[Any, int] | None:
        self._check("get")
        return super().get(from_stage, to_stage, get_key, metadata)

    def get_with_deadline(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
        *,
        deadline: float,
    ) -> tuple[Any, int] | None:
        self._check("get_with_deadline")
        return super().get_with_deadline(from_stage, to_stage, get_key, metadata, deadline=deadline)

    def abandon_get(self, get_key: str) -> None:
        self._check("abandon_get")
        super().abandon_get(get_key)

    def cleanup_prefix(self, prefix: str) -> int:
        self._check("cleanup_prefix")
        return super().cleanup_prefix(prefix)

    def cleanup(self, request_id: str) -> bool:
        self._check("cleanup")
        return super().cleanup(request_id)

    def drain_failures(self) -> list[TransferFailure]:
        self._check("drain_failures")
        return super().drain_failures()

    def health(self) -> dict[str, Any]:
        self._check("health")
        return super().health()

    def flush(self, timeout_s: float) -> bool:
        self._check("flush")
        return super().flush(timeout_s)


def _wait(condition: Any, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_no_connector_call_runs_under_the_managers_lock() -> None:
    namespace = f"lock-{uuid.uuid4().hex}"
    conn0 = LockCheckingConnector({"namespace": namespace, "stage_id": "0"})
    conn1 = LockCheckingConnector({"namespace": namespace, "stage_id": "1"})
    common: dict[str, Any] = {"retry": FAST_RETRY, "recv_wait_s": 0.005}
    # Short enough to see a stall and an age-out, long enough for a busy machine's streams to go through.
    sender = OmniChunkManager(ChunkManagerConfig(stage_id="0", idle_state_timeout_s=0.5, **common), conn0)
    receiver = OmniChunkManager(ChunkManagerConfig(stage_id="1", stall_timeout_s=2.0, **common), conn1)
    conn0.manager, conn1.manager = sender, receiver
    try:
        # A whole stream, taken as it arrives (gets, the final chunk's cleanup).
        receiver.load_async("whole")
        for n in range(3):
            sender.save_async("whole", {"x": np.full(4, n)}, is_final=n == 2)
        taken: list[int] = []

        def take() -> bool:
            inputs = receiver.take_inputs("whole")
            if inputs is not None:
                taken.append(inputs.num_chunks)
                return inputs.is_final
            return False

        _wait(take, "the stream never arrived whole")
        assert sum(taken) == 3
        # Cancel and release while receiving (abandon_get + cleanup_prefix), both sides.
        for request in ("cancelled", "released"):
            receiver.load_async(request)
            assert sender.save(request, {"x": np.zeros(2)}, is_final=False, timeout_s=5.0)
            _wait(lambda r=request: receiver.is_ready(r), "chunk 0 never arrived")  # type: ignore[misc]
        receiver.cancel("cancelled")
        sender.cancel("cancelled")
        receiver.release("released")
        sender.release("released")
        # A stall, a bad chunk and a load() timeout fail their streams.
        receiver.load_async("stalled")
        receiver.load_async("bad")
        conn0.put("0", "1", receiver.recv_key("bad", 0), {"not": "a chunk"})
        assert receiver.load("timeout", timeout_s=0.2) is None
        lost: dict[str, str] = {}
        _wait(
            lambda: (
                {"stalled", "bad", "timeout"} <= lost.keys()
                or bool(lost.update(receiver.collect_failed_receive_request_ids()))
            ),
            f"the stall, the bad chunk or the load timeout was not reported: {lost}",
        )
        # A put that keeps failing, and a stream left open until it ages out.
        conn0.fail_puts[sender.send_key("dead", 0)] = 100
        assert not sender.save("dead", {"x": np.zeros(1)}, timeout_s=5.0)
        assert sender.save("idle", {"x": np.zeros(1)}, is_final=False, timeout_s=5.0)
        failed: dict[str, str] = {}
        _wait(lambda: "idle" in failed or bool(failed.update(sender.collect_failed_send_request_ids())), "no age-out")
        assert "dead" in failed and "abandoned" in failed["idle"]
        sender.health()
        receiver.health()
    finally:
        sender.shutdown()
        receiver.shutdown()
        conn0.close()
        conn1.close()
    assert conn0.under_lock == [] and conn1.under_lock == []
    calls = conn0.calls + conn1.calls
    for name in ("put", "get", "abandon_get", "cleanup_prefix", "drain_failures", "health"):
        assert calls[name] > 0, f"the scenario never made a {name} call: {dict(calls)}"


class BlockingCleanupConnector(LockCheckingConnector):
    """A LockCheckingConnector whose ``cleanup_prefix`` waits for ``go`` (it signals ``entered`` first)."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.entered = threading.Event()
        self.go = threading.Event()

    def cleanup_prefix(self, prefix: str) -> int:
        self.entered.set()
        assert self.go.wait(10), "the test never let the clean-up go on"
        return super().cleanup_prefix(prefix)


def test_a_reused_id_loads_after_its_old_streams_clean_up() -> None:
    """A cancel's clean-up runs after the lock: a load of the same id waits for it, so no new chunk is dropped.

    The new stream's chunks have the old stream's keys. Had ``load_async`` returned while the old
    stream's ``cleanup_prefix`` was still to run, the chunks streamed after it would be dropped by it.
    """
    namespace = f"reuse-{uuid.uuid4().hex}"
    receiving = BlockingCleanupConnector({"namespace": namespace, "stage_id": "1"})
    old_conn = LockCheckingConnector({"namespace": namespace, "stage_id": "0"})
    new_conn = LockCheckingConnector({"namespace": namespace, "stage_id": "0"})
    common: dict[str, Any] = {"retry": FAST_RETRY, "recv_wait_s": 0.005}
    receiver = OmniChunkManager(ChunkManagerConfig(stage_id="1", stall_timeout_s=30.0, **common), receiving)
    old = OmniChunkManager(ChunkManagerConfig(stage_id="0", **common), old_conn)
    new = OmniChunkManager(ChunkManagerConfig(stage_id="0", **common), new_conn)  # the upstream, restarted
    receiving.manager = receiver
    loaded = threading.Event()
    streamed = threading.Event()
    threads: list[threading.Thread] = []
    try:
        receiver.load_async("r")
        assert old.save("r", {"x": np.zeros(2)}, is_final=False, timeout_s=5.0)
        _wait(lambda: receiver.is_ready("r"), "chunk 0 of the old stream never arrived")
        threads.append(threading.Thread(target=receiver.cancel, args=("r",), name="cancel"))
        threads[-1].start()
        assert receiving.entered.wait(10), "the cancel never cleaned up"  # its clean-up now waits for go

        def load_and_stream() -> None:
            receiver.load_async("r")
            loaded.set()
            for n in range(3):
                assert new.save("r", {"x": np.full(2, n)}, is_final=n == 2, timeout_s=5.0)
            streamed.set()

        threads.append(threading.Thread(target=load_and_stream, name="reload"))
        threads[-1].start()
        # Long enough for an unguarded load to return and stream all three chunks into the old clean-up.
        streamed.wait(0.5)
        assert not loaded.is_set() and not receiver.is_receiving("r"), "the load did not wait for the clean-up"
        receiving.go.set()
        assert streamed.wait(10), "the new stream was never sent"
        got: list[int] = []

        def take() -> bool:
            inputs = receiver.take_inputs("r")
            if inputs is None:
                return False
            got.extend(int(v) for v in inputs.data["x"][::2])
            return inputs.is_final

        _wait(take, f"the new stream did not arrive whole: {got}")
        assert got == [0, 1, 2]
        assert receiver.collect_failed_receive_request_ids() == {}
    finally:
        receiving.go.set()
        for thread in threads:
            thread.join(10)
        for manager in (receiver, old, new):
            manager.shutdown()
        for conn in (receiving, old_conn, new_conn):
            conn.close()
    assert receiving.under_lock == []

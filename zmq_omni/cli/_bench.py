"""``zmq-omni bench``: a compact benchmark grid, one table of ratios.

Rows, each measured in the same run as its baseline so the ratio holds on a
busy machine even when absolute times do not:

* **codec**: ``zmq_omni.wire`` encode+decode of a dict holding one float32
  array against an in-band ``pickle`` round trip of the same dict (what a
  serializer that returns one ``bytes`` object costs: vllm-omni's copies too).
* **ZmqConnector ipc / tcp**: one ``put`` then ``get_with_deadline`` between two
  connectors against raw pyzmq PUSH/PULL (``copy=False``) of the same bytes
  over the same transport.
* **shared memory**: ``SharedMemoryConnector`` put then get, and
  ``ZmqConnector`` over ipc with ``shm: on``, against one ``memcpy`` of the
  payload (``np.copyto``).

Ratios above 1 mean zmq_omni is faster than the baseline (``baseline time /
our time``); for the shared-memory rows the baseline is a single memcpy, so
1.0 would be "as fast as copying the bytes once". Figures are the best of a
few repeats. The plot (``--plot``) needs the ``plot`` extra (matplotlib).
"""

from __future__ import annotations

import argparse
import pickle
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from ..connectors import OmniConnectorBase, create_connector
from ..wire import decode, encode

__all__ = ["run_bench"]

KIB = 1024
MIB = 1024 * KIB


def _best(fn: Callable[[], None], *, repeats: int, budget_s: float) -> float:
    """Best time of ``fn`` over ``repeats`` runs (fewer when the budget runs out)."""
    fn()  # warm-up: first-touch page faults and socket connects are not what we measure
    best = float("inf")
    spent = time.perf_counter()
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
        if time.perf_counter() - spent > budget_s:
            break
    return best


def _payload(size: int) -> dict[str, Any]:
    return {"hidden": np.random.default_rng(0).standard_normal(size // 4, dtype=np.float32), "request": "r", "n": 1}


def _codec(size: int, repeats: int) -> tuple[float, float]:
    obj = _payload(size)

    def ours() -> None:
        out = decode(encode(obj))
        assert out["hidden"].nbytes == size

    def baseline() -> None:
        out = pickle.loads(pickle.dumps(obj, protocol=5))
        assert out["hidden"].nbytes == size

    return _best(ours, repeats=repeats, budget_s=3), _best(baseline, repeats=repeats, budget_s=3)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _endpoint(transport: str, workdir: Path, name: str) -> str:
    return f"ipc://{workdir}/{name}" if transport == "ipc" else f"tcp://127.0.0.1:{_free_port()}"


def _connector_pair(endpoint: str, shm: str) -> tuple[OmniConnectorBase, OmniConnectorBase]:
    extra = {"endpoints": {"1": endpoint}, "shm": shm, "put_timeout_s": 30.0, "delivery_timeout_s": 60.0}
    receiver = create_connector({"name": "ZmqConnector", "extra": {**extra, "stage_id": "1", "role": "receiver"}})
    try:
        sender = create_connector({"name": "ZmqConnector", "extra": {**extra, "stage_id": "0", "role": "sender"}})
    except BaseException:
        receiver.close()
        raise
    return sender, receiver


def _put_get(sender: OmniConnectorBase, receiver: OmniConnectorBase, obj: Any, size: int,
             repeats: int) -> float:
    counter = iter(range(1 << 30))

    def once() -> None:
        key = f"b_0_{next(counter)}"
        ok, _, _ = sender.put("0", "1", key, obj)
        if not ok:
            raise RuntimeError(f"bench put failed: {sender.drain_failures()}")
        got = receiver.get_with_deadline("0", "1", key, deadline=time.monotonic() + 30)
        if got is None or got[0]["hidden"].nbytes != size:
            raise RuntimeError("bench get failed")

    return _best(once, repeats=repeats, budget_s=3)


def _raw_pyzmq(endpoint: str, size: int, repeats: int) -> float:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    push = ctx.socket(zmq.PUSH)
    try:
        pull.bind(endpoint)
        push.connect(endpoint)
        buf = np.random.default_rng(0).standard_normal(size // 4, dtype=np.float32)
        header = b"h" * 64

        def once() -> None:
            push.send_multipart([header, buf.data], copy=False)
            frames = pull.recv_multipart(copy=False)
            assert len(frames[1].buffer) == size

        return _best(once, repeats=repeats, budget_s=3)
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()


def _zmq_row(transport: str, size: int, repeats: int, workdir: Path) -> tuple[float, float]:
    sender, receiver = _connector_pair(_endpoint(transport, workdir, f"c{uuid.uuid4().hex[:8]}"), "off")
    try:
        ours = _put_get(sender, receiver, _payload(size), size, repeats)
    finally:
        sender.close()
        receiver.close()
    return ours, _raw_pyzmq(_endpoint(transport, workdir, f"r{uuid.uuid4().hex[:8]}"), size, repeats)


def _memcpy(size: int, repeats: int) -> float:
    src = np.random.default_rng(0).standard_normal(size // 4, dtype=np.float32)
    dst = np.empty_like(src)
    return _best(lambda: np.copyto(dst, src), repeats=repeats, budget_s=2)


def _shm_connector_row(size: int, repeats: int) -> float:
    namespace = f"bench{uuid.uuid4().hex[:8]}"
    sender = create_connector({"name": "SharedMemoryConnector", "extra": {"namespace": namespace}})
    receiver = create_connector({"name": "SharedMemoryConnector", "extra": {"namespace": namespace}})
    try:
        return _put_get(sender, receiver, _payload(size), size, repeats)
    finally:
        sender.close()
        receiver.close()


def _zmq_shm_row(size: int, repeats: int, workdir: Path) -> float:
    sender, receiver = _connector_pair(_endpoint("ipc", workdir, f"s{uuid.uuid4().hex[:8]}"), "on")
    try:
        return _put_get(sender, receiver, _payload(size), size, repeats)
    finally:
        sender.close()
        receiver.close()


def _ms(seconds: float) -> str:
    return f"{seconds * 1e6:.1f}us" if seconds < 1e-3 else f"{seconds * 1e3:.2f}ms"


def _size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


def run_bench(args: argparse.Namespace) -> int:
    """Run the grid, print the table (and write the plot when matplotlib is installed)."""
    quick = bool(args.quick)
    codec_sizes = [64 * KIB, 4 * MIB] if quick else [64 * KIB, 1 * MIB, 16 * MIB, 64 * MIB]
    zmq_sizes = [64 * KIB, 4 * MIB] if quick else [64 * KIB, 1 * MIB, 16 * MIB, 64 * MIB]
    shm_sizes = [4 * MIB] if quick else [1 * MIB, 16 * MIB, 64 * MIB]
    repeats = 3 if quick else 7
    rows: list[tuple[str, str, int, float, float]] = []  # (row, baseline, size, ours_s, base_s)
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="zo-bench-", dir="/tmp"))
    print(f"{'benchmark':<34} {'size':>8} {'ours':>10} {'baseline':>10} {'ratio':>7}  baseline", flush=True)

    def emit(row: str, baseline: str, size: int, ours: float, base: float) -> None:
        rows.append((row, baseline, size, ours, base))
        print(f"{row:<34} {_size(size):>8} {_ms(ours):>10} {_ms(base):>10} {base / ours:>6.2f}x  {baseline}",
              flush=True)

    try:
        for size in codec_sizes:
            emit("codec encode+decode", "pickle dumps+loads (in-band)", size, *_codec(size, repeats))
        for transport in ("ipc", "tcp"):
            for size in zmq_sizes:
                emit(f"ZmqConnector {transport} put->get", f"raw pyzmq {transport} copy=False", size,
                     *_zmq_row(transport, size, repeats, workdir))
        for size in shm_sizes:
            copy = _memcpy(size, repeats)
            emit("SharedMemoryConnector put->get", "one memcpy", size, _shm_connector_row(size, repeats), copy)
            emit("ZmqConnector ipc shm=on put->get", "one memcpy", size, _zmq_shm_row(size, repeats, workdir), copy)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"\nratio = baseline time / zmq_omni time (higher is better); best of up to {repeats} runs; "
          f"grid took {time.monotonic() - started:.1f} s", flush=True)
    _plot(rows, args.plot)
    return 0


def _plot(rows: list[tuple[str, str, int, float, float]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no plot: install the 'plot' extra, pip install 'zmq-omni[plot]')")
        return
    labels = [f"{row}\n{_size(size)}" for row, _, size, _, _ in rows]
    ratios = [base / ours for _, _, _, ours, base in rows]
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.6), 5))
    ax.bar(range(len(rows)), ratios)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=7)
    ax.set_ylabel("baseline time / zmq_omni time")
    ax.set_title("zmq-omni bench")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot written to {path}")

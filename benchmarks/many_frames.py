"""One message of millions of frames at a bound ROUTER: how each way of reading it treats the other peers.

Run: ``python benchmarks/many_frames.py`` (``--frames 1000000 10000000`` by default;
about two minutes on 2 cores).

libzmq queues a multipart message whole before its first frame can be read, and
has no bound on its frame count (``MAXMSGSIZE`` is per frame): a peer streaming
one message of N empty frames (2 bytes each on the wire) makes the reader take N
frames, one ``recv`` each, before anything else on the socket. Three readers are
measured, each in a thread that owns a ROUTER on ``tcp://127.0.0.1``, answers
one-frame requests at once, and gives up a turn (returns to its poller) when it
has read for ``--budget-ms``:

- ``whole``: reads each message to its end in one turn (a message of too many
  frames is drained, then dropped);
- ``skip``: reads at most its budget a turn, and carries the message it is
  skipping to the next turn (a skip state: the turn is bounded, not the blackout);
- ``rebind``: as ``skip``, and once a message passes ``--max-frames`` frames it
  closes the ROUTER (libzmq frees the rest of that message with it) and binds a
  new one on the same endpoint (peers reconnect).

A real peer (a DEALER in its own thread) asks every 5 ms and waits for each
answer (asking again after 250 ms without one: an ask lost to a rebind); an attacker
(a raw ZMTP writer on a TCP socket, no ZeroMQ) sends one message of N frames. The
table gives, per reader and N: the attacker's send time, the longest turn of the
reader (what an event loop driving it would stall), the longest the real peer
waited for an answer (the blackout), how many of its asks it sent again, and
the process's RSS before, at its peak (libzmq holds the whole message), and 2 s
after the attack.

A second table (``--trims``; ``--trims-only`` skips the first) gives what handing
the dropped message's memory back costs a thread beside it, as an event loop's
thread would be: on a heap tuned as the connectors tune it (one arena, no mmap),
640 MB in 16 KB blocks (libzmq's pipe chunks) are freed, either at the heap's top
or below a live block, then a thread hands them back: ``one`` (a single
``malloc_trim(0)``) or ``steps`` (``trim_malloc_in_steps``, as the receivers do
after a rebind). A ticking thread allocates 2 KB every millisecond (from the same
heap) and keeps its longest gap, less the time it waited for a CPU.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import socket
import struct
import threading
import time
from typing import Any

import zmq

_GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
_READY_BODY = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
_LIBC = ctypes.CDLL(ctypes.util.find_library("c"))
_REASK_MS = 250  # the real peer asks again after this long without an answer (an ask lost to a rebind)
_READY = b"\x04" + bytes([len(_READY_BODY)]) + _READY_BODY


def zmtp_flood(port: int, frames: int, hold_s: float = 3.0) -> float:
    """Send one message of ``frames`` empty frames as a ZMTP 3.0 DEALER (NULL mechanism); the send's seconds."""
    wire = b"\x01\x00" * (frames - 1) + b"\x00\x00"
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(_GREETING + _READY)
        conn.recv(64)  # the server's greeting (its READY follows; nothing else is read)
        start = time.perf_counter()
        conn.sendall(wire)
        took = time.perf_counter() - start
        # Held open until the server closes it, or a while: closed earlier, libzmq drops a message
        # it has not finished taking in.
        conn.settimeout(hold_s)
        end = time.monotonic() + hold_s
        try:
            while time.monotonic() < end and conn.recv(65536):
                pass
        except OSError:  # timed out, or reset by the server
            pass
    return took


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


class Reader(threading.Thread):
    """A ROUTER answering one-frame requests, read in the way ``how`` names (see the module docstring)."""

    def __init__(self, ctx: zmq.Context[Any], how: str, budget_s: float, max_frames: int) -> None:
        super().__init__(daemon=True)
        self.ctx, self.how, self.budget, self.max_frames = ctx, how, budget_s, max_frames
        self.sock = self._bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.port = int(self.endpoint.rsplit(":", 1)[1])
        self.worst_turn = 0.0
        self.rebinds = 0
        self.stop = threading.Event()
        self._more = False  # in the middle of a message being skipped
        self._skipped = 0

    def _bind(self, endpoint: str) -> Any:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        deadline = time.monotonic() + 2
        while True:
            try:
                sock.bind(endpoint)
                return sock
            except zmq.ZMQError:  # the old listener is still closing
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.001)

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(20, zmq.POLLIN):
                continue
            start = time.perf_counter()
            self._turn(start)
            self.worst_turn = max(self.worst_turn, time.perf_counter() - start)
        self.sock.close()

    def _turn(self, start: float) -> None:
        sock, until = self.sock, start + self.budget
        while time.perf_counter() < until or (self.how == "whole" and self._more):
            if self._more:
                for _ in range(64):
                    frame = sock.recv(copy=False)
                    self._skipped += 1
                    if not frame.more:
                        self._more = False
                        break
                if self._more and self.how == "rebind" and self._skipped > self.max_frames:
                    self.rebinds += 1
                    sock.close(linger=0)
                    self.sock = sock = self._bind(self.endpoint)
                    self._more = False
                    return
                continue
            try:
                identity = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            head = sock.recv(copy=False)
            if head.more:
                self._more, self._skipped = True, 1
                continue
            sock.send_multipart([identity, head.bytes], zmq.NOBLOCK)


def real_peer(ctx: zmq.Context[Any], endpoint: str, stop: threading.Event, out: dict[str, Any]) -> None:
    """Ask every 5 ms, each answer awaited (asked again after ``_REASK_MS``): the longest wait, the asks re-sent."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, 50)
    sock.connect(endpoint)
    worst, lost, asks = 0.0, 0, 0
    while not stop.is_set():
        asked = time.perf_counter()
        asks += 1
        sock.send(struct.pack("<d", asked))
        while not stop.is_set():
            if sock.poll(_REASK_MS, zmq.POLLIN):
                sock.recv()
                break
            lost += 1
            sock.send(struct.pack("<d", time.perf_counter()))
        worst = max(worst, time.perf_counter() - asked)
        time.sleep(0.005)
    out.update(worst=worst, lost=lost, asks=asks)
    sock.close()


def run(how: str, frames: int, budget_s: float, max_frames: int) -> dict[str, Any]:
    ctx = zmq.Context()
    reader = Reader(ctx, how, budget_s, max_frames)
    reader.start()
    stop, out = threading.Event(), {}
    peer = threading.Thread(target=real_peer, args=(ctx, reader.endpoint, stop, out), daemon=True)
    peer.start()
    time.sleep(0.5)
    before, peaks = rss_mb(), [0.0]
    sent: dict[str, float] = {}
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            peaks.append(rss_mb())
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    attacker = threading.Thread(target=lambda: sent.update(s=zmtp_flood(reader.port, frames)), daemon=True)
    attacker.start()
    attacker.join()
    end = time.monotonic() + 120
    while time.monotonic() < end and (reader._more or not (reader._skipped or reader.rebinds)):
        time.sleep(0.05)  # until the reader took the whole message (or dropped it)
    time.sleep(1.0)
    if how == "rebind":
        _LIBC.malloc_trim(0)  # the message's pages, freed with the socket, go back to the OS
    time.sleep(1.0)
    sampling.set()
    sampler.join()
    after, peak = rss_mb(), max(peaks)
    stop.set()
    peer.join(5)
    reader.stop.set()
    reader.join(5)
    ctx.term()
    return {
        "send_s": sent.get("s", float("nan")),
        "turn_ms": reader.worst_turn * 1000,
        "blackout_ms": out.get("worst", float("nan")) * 1000,
        "lost": out.get("lost", -1),
        "rss": (before, max(peak, before), after),
        "rebinds": reader.rebinds,
    }


def _runqueue_wait_s() -> float:
    with open("/proc/thread-self/schedstat") as stats:
        return int(stats.read().split()[1]) / 1e9


def trim_cost(how: str, below_live: bool, megabytes: int = 640) -> dict[str, float]:
    """One hand-back of ``megabytes`` freed 16 KB blocks: the ticking thread's worst gap, the trim's time, RSS."""
    from zmq_omni.transport._router import trim_malloc_in_steps

    _LIBC.malloc.restype = ctypes.c_void_p
    _LIBC.malloc.argtypes = [ctypes.c_size_t]
    _LIBC.free.argtypes = [ctypes.c_void_p]
    _LIBC.malloc_trim(0)
    blocks = [_LIBC.malloc(16 << 10) for _ in range(megabytes << 6)]
    for block in blocks:
        ctypes.memset(block, 1, 16 << 10)
    live = _LIBC.malloc(1 << 20) if below_live else None
    if live:
        ctypes.memset(live, 1, 1 << 20)
    for block in blocks:
        _LIBC.free(block)
    before, stop, worst = rss_mb(), threading.Event(), [0.0]

    def tick() -> None:
        last, queued = time.monotonic(), _runqueue_wait_s()
        while not stop.is_set():
            time.sleep(0.001)
            bytearray(2048)  # from the C heap, as an event loop's objects are
            now, queued_now = time.monotonic(), _runqueue_wait_s()
            worst[0] = max(worst[0], now - last - (queued_now - queued))
            last, queued = now, queued_now

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    time.sleep(0.05)
    worst[0] = 0.0
    start = time.monotonic()
    trimmer = threading.Thread(target=(lambda: _LIBC.malloc_trim(0)) if how == "one" else trim_malloc_in_steps)
    trimmer.start()
    trimmer.join()
    took = time.monotonic() - start
    time.sleep(0.02)
    stop.set()
    ticker.join()
    if live:
        _LIBC.free(live)
    return {"gap_ms": worst[0] * 1000, "trim_ms": took * 1000, "before": before, "after": rss_mb()}


def trims(reps: int) -> None:
    from zmq_omni.transport import tune_malloc

    if not tune_malloc():
        print("glibc's malloc not tunable here: no trim table")
        return
    print(f"\n{'trim':<6} {'freed':<12} {'worst gap ms':>13} {'trim ms':>8} {'RSS MB before/after':>20}")
    for below_live in (False, True):
        for how in ("one", "steps"):
            for _ in range(reps):
                row = trim_cost(how, below_live)
                where = "below a live" if below_live else "at the top"
                print(
                    f"{how:<6} {where:<12} {row['gap_ms']:>13.1f} {row['trim_ms']:>8.0f} "
                    f"{row['before']:>11.0f}/{row['after']:.0f}",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--ways", nargs="+", default=["whole", "skip", "rebind"])
    parser.add_argument("--budget-ms", type=float, default=10.0)
    parser.add_argument("--max-frames", type=int, default=65536)
    parser.add_argument("--trims", action="store_true", help="also the table of trims")
    parser.add_argument("--trims-only", action="store_true", help="the table of trims alone")
    parser.add_argument("--reps", type=int, default=3, help="runs of each trim")
    args = parser.parse_args()
    if args.trims_only:
        trims(args.reps)
        return
    print(f"pyzmq {zmq.__version__}, libzmq {zmq.zmq_version()}; budget {args.budget_ms} ms, ", end="")
    print(f"max_frames {args.max_frames}")
    head = f"{'reader':<7} {'frames':>10} {'send s':>7} {'turn ms':>8} {'blackout ms':>12} {'lost':>5} {'rebinds':>8}"
    print(f"{head} {'RSS MB before/peak/after':>26}")
    for frames in args.frames:
        for how in args.ways:
            row = run(how, frames, args.budget_ms / 1000, args.max_frames)
            rss = "/".join(f"{v:.0f}" for v in row["rss"])
            print(
                f"{how:<7} {frames:>10} {row['send_s']:>7.2f} {row['turn_ms']:>8.1f} {row['blackout_ms']:>12.1f} "
                f"{row['lost']:>5} {row['rebinds']:>8} {rss:>26}",
                flush=True,
            )
    if args.trims:
        trims(args.reps)


if __name__ == "__main__":
    main()

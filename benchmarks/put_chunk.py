"""``put`` of vllm-omni's ~4 KiB thinker chunk: ZmqConnector push (ipc, or tcp) against main's SharedMemoryConnector.

Run as a script (not a test)::

    python benchmarks/put_chunk.py [--rounds 300] [--pace-ms 20] [--breakdown] [--transport ipc|tcp] [--shm auto|on|off]

The payload is the thinker's decode chunk as main's ``thinker2talker_async_chunk``
builds it: main's ``OmniPayloadStruct`` (msgspec, ``omit_defaults``) holding
``embed.decode`` ``[1, 2048]`` bf16 and ``meta.finished``/``is_segment_finished``
(0-d bool tensors). One receiver process takes every chunk of both backends with
main's receive loop (``get`` polled, 1 ms back-off) and checks its values. The
sender puts one chunk every ``--pace-ms`` on one thread, alternating ours and the
baseline (main's ``SharedMemoryConnector``, restated in ``zmq_omni.bench._vllm_main``),
so both meet the same machine. Each ``put`` is timed alone (``time.perf_counter``
around the call); the first 20 of each are warm-up. The ratio is the baseline's
p50 / ours (above 1, ours is faster). ``--breakdown`` adds, for ours, the p50 of
``encode`` and of the sender's ``send`` (the window admission and ZeroMQ's send),
timed by wrapping them; the rest is the connector's own bookkeeping. Needs torch
and msgspec.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import secrets
import statistics
import sys
import tempfile
import time
from typing import Any

WARMUP = 20


def _receiver(endpoints: dict[str, str], keys: list[str], queue: Any, shm: str) -> None:
    from zmq_omni.bench._vllm_main import MainShmConnector
    from zmq_omni.bench._vllm_stage import Payloads, PayloadShapes
    from zmq_omni.connectors import create_connector

    extra = {"mode": "push", "endpoints": endpoints, "stage_id": 1, "role": "receiver", "shm": shm}
    ours = create_connector({"name": "ZmqConnector", "extra": extra})
    theirs = MainShmConnector({"stage_id": 1})
    payloads = Payloads(PayloadShapes())
    queue.put("up")
    problems = []
    try:
        for key in keys:
            connector = theirs if key.startswith("m") else ours
            while (got := connector.get("0", "1", key)) is None:
                time.sleep(0.001)  # main's receive loop
            chunk = int(key.rsplit("_", 1)[1])
            problem = payloads.check_thinker_chunk(got[0], 1, 0, chunk, False)
            if problem:
                problems.append(f"{key}: {problem}")
    finally:
        queue.put(problems)
        ours.close()
        theirs.close()


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=300, help="puts of each backend (the first 20 are warm-up)")
    parser.add_argument("--pace-ms", type=float, default=20.0, help="ms between two puts (0: back to back)")
    parser.add_argument("--inline-threshold", type=int, default=None, help="our connector's inline_threshold")
    parser.add_argument("--transport", choices=("ipc", "tcp"), default="ipc", help="our connector's endpoints")
    parser.add_argument("--shm", choices=("auto", "on", "off"), default="auto", help="our connector's shm setting")
    parser.add_argument("--breakdown", action="store_true", help="also time encode and the sender's send (ours)")
    args = parser.parse_args()

    import torch  # noqa: F401  (fails early when missing)

    from zmq_omni.bench._vllm_main import MainShmConnector
    from zmq_omni.bench._vllm_stage import Payloads, PayloadShapes
    from zmq_omni.connectors import _zmq_puts, create_connector
    from zmq_omni.transport import _sender, reserve_loopback_port

    tmp = tempfile.mkdtemp(prefix="zmq-omni-put-")
    if args.transport == "ipc":
        endpoints = {str(s): f"ipc://{tmp}/s{s}.sock" for s in (0, 1)}
    else:
        endpoints = {str(s): f"tcp://127.0.0.1:{reserve_loopback_port()}" for s in (0, 1)}
    nonce = secrets.token_hex(4)
    rounds = args.rounds + WARMUP
    keys = [key for n in range(1, rounds + 1) for key in (f"z{nonce}_{n}", f"m{nonce}_{n}")]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(endpoints, keys, queue, args.shm), daemon=True)
    proc.start()
    if queue.get(timeout=60) != "up":
        return 1
    extra: dict[str, Any] = {"mode": "push", "endpoints": endpoints, "stage_id": 0, "role": "sender", "shm": args.shm}
    if args.inline_threshold is not None:
        extra["inline_threshold"] = args.inline_threshold
    ours = create_connector({"name": "ZmqConnector", "extra": extra})
    theirs = MainShmConnector({"stage_id": 0})
    parts: dict[str, list[float]] = {"encode": [], "send": []}
    if args.breakdown:
        for owner, name, label in ((_zmq_puts, "encode", "encode"), (_sender.PushSender, "send", "send")):
            inner = getattr(owner, name)

            def timed(*a: Any, _inner: Any = inner, _label: str = label, **k: Any) -> Any:
                start = time.perf_counter()
                try:
                    return _inner(*a, **k)
                finally:
                    parts[_label].append((time.perf_counter() - start) * 1e6)

            setattr(owner, name, timed)
    payloads = Payloads(PayloadShapes())
    chunks = [payloads.thinker_chunk(1, 0, n, False) for n in range(1, rounds + 1)]
    times: dict[str, list[float]] = {"ours": [], "theirs": []}
    pace = args.pace_ms / 1e3
    try:
        time.sleep(0.5)  # the receiver's verdict and first replies
        for n, chunk in enumerate(chunks, 1):
            for name, connector, key in (("ours", ours, f"z{nonce}_{n}"), ("theirs", theirs, f"m{nonce}_{n}")):
                if pace:
                    time.sleep(pace)
                start = time.perf_counter()
                ok = connector.put("0", "1", key, chunk)[0]
                times[name].append((time.perf_counter() - start) * 1e6)
                if not ok:
                    print(f"put_chunk.py: {name} put {key} failed", file=sys.stderr)
                    return 1
        problems = queue.get(timeout=120)
    finally:
        ours.close()
        theirs.close()
        proc.join(10)
    if problems:
        print("put_chunk.py: FAILED:", *problems[:5], sep="\n  ", file=sys.stderr)
        return 1
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"put of a ~4 KiB thinker chunk, {args.rounds} each, a put every {args.pace_ms:g} ms; load average {load}")
    ours_t, theirs_t = times["ours"][WARMUP:], times["theirs"][WARMUP:]
    for label, values in ((f"ZmqConnector push {args.transport}", ours_t), ("main's SharedMemoryConnector", theirs_t)):
        spread = "  ".join(f"p{round(q * 100)} {_p(values, q):7.1f} us" for q in (0.5, 0.9, 0.99))
        print(f"  {label:<30} {spread}")
    for label, values in parts.items():
        if values:
            print(f"    ours: {label:<21} p50 {statistics.median(values[WARMUP:]):7.1f} us")
    print(f"  ratio (theirs / ours, p50): {_p(theirs_t, 0.5) / _p(ours_t, 0.5):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

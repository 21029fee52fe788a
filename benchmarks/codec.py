"""Wire codec benchmark: zmq_omni.wire against pickle-5 and msgpack, plus one memcpy as reference.

Run as a script (not a test)::

    python benchmarks/codec.py              # the codec table (~30-60 s)
    python benchmarks/codec.py --threshold  # the inline-threshold crossover over a real socket

Every figure is the median per-call time over many timed batches of
encode+decode (after a warm-up call). The contenders of a row are measured
interleaved, batch by batch, so a noisy neighbour slows all of them alike and
the ratios hold on a busy machine even when the absolute times do not.
"""

from __future__ import annotations

import argparse
import itertools
import os
import pickle
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import zmq

from zmq_omni.wire import DEFAULT_INLINE_THRESHOLD, decode, encode

KIB = 1024
MIB = 1024 * KIB
SIZES = [1 * KIB, 64 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB]
SMALL_META = {
    "request_id": "chatcmpl-4f9a2c1e-0001",
    "stage_id": 1,
    "chunk_id": 17,
    "finished": False,
    "prompt_len": 1024,
    "sampling": {"temperature": 0.7, "top_p": 0.95, "max_tokens": 2048, "seed": 1234},
    "token_ids": [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13],
    "lang": "en",
}


def median_seconds(fns: dict[str, Callable[[], Any]], budget: float, repeats: int) -> dict[str, float]:
    """Median per-call seconds of each function over ``repeats`` batches, interleaved.

    Each function is warmed up, then timed in batches of ``number`` calls, with
    ``number`` chosen so one batch lasts about ``budget / repeats`` seconds
    (at least one call): fast functions get many calls per batch, so timer
    resolution and call jitter average out.
    """
    numbers = {}
    for name, fn in fns.items():
        fn()  # warm-up: first-touch page faults, caches, lazy imports
        start = time.perf_counter()
        fn()
        once = max(time.perf_counter() - start, 1e-7)
        numbers[name] = max(1, min(1_000_000, int(budget / repeats / once)))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            number = numbers[name]
            start = time.perf_counter()
            for _ in range(number):
                fn()
            samples[name].append((time.perf_counter() - start) / number)
    return {name: statistics.median(times) for name, times in samples.items()}


def ours(payload: Any) -> Callable[[], Any]:
    return lambda: decode(encode(payload))


def pickle5(payload: Any) -> Callable[[], Any]:
    def run() -> Any:
        buffers: list[pickle.PickleBuffer] = []
        data = pickle.dumps(payload, protocol=5, buffer_callback=buffers.append)
        return pickle.loads(data, buffers=buffers)

    return run


def msgpack_copy(payload: dict[str, Any]) -> Callable[[], Any]:
    def pack_array(obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            return {"dtype": obj.dtype.str, "shape": obj.shape, "data": obj.tobytes()}
        raise TypeError(type(obj))

    def run() -> Any:
        out = msgpack.unpackb(msgpack.packb(payload, default=pack_array))
        for key, value in out.items():
            if isinstance(value, dict) and "data" in value:
                out[key] = np.frombuffer(value["data"], dtype=value["dtype"]).reshape(value["shape"])
        return out

    return run


def memcpy(dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any]) -> Callable[[], Any]:
    return lambda: np.copyto(dst, src)


def fmt_us(seconds: float) -> str:
    return f"{seconds * 1e6:12.2f}"


def codec_table() -> None:
    print(f"zmq_omni.wire codec benchmark (inline threshold {DEFAULT_INLINE_THRESHOLD} B); times in microseconds")
    print("encode+decode of a dict {request_id, array}; memcpy = np.copyto of the array into a preallocated one\n")
    header = (
        f"{'payload':>10} {'zmq_omni':>12} {'pickle5-oob':>12} {'msgpack-copy':>12} {'memcpy':>12} "
        f"{'ours/memcpy':>12} {'pickle/ours':>12} {'msgpack/ours':>13}"
    )
    print(header)
    print("-" * len(header))
    for size in SIZES:
        arr = np.random.default_rng(0).standard_normal(size // 4).astype(np.float32)
        payload = {"request_id": "chatcmpl-4f9a2c1e-0001", "hidden_states": arr}
        dst = np.empty_like(arr)
        # More, shorter batches for small sizes; the large rows are few calls per batch anyway.
        budget, repeats = (0.5, 21) if size <= 16 * MIB else (1.0, 7)
        times = median_seconds(
            {
                "ours": ours(payload),
                "pickle": pickle5(payload),
                "msgpack": msgpack_copy(payload),
                "copy": memcpy(dst, arr),
            },
            budget,
            repeats,
        )
        t_ours, t_pickle, t_msgpack, t_copy = times["ours"], times["pickle"], times["msgpack"], times["copy"]
        label = f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"
        print(
            f"{label:>10} {fmt_us(t_ours)} {fmt_us(t_pickle)} {fmt_us(t_msgpack)} {fmt_us(t_copy)} "
            f"{t_ours / t_copy:11.2%} {t_pickle / t_ours:11.2f}x {t_msgpack / t_ours:12.2f}x"
        )
        del arr, dst, payload
    fresh_shapes()
    packed = msgpack.packb(SMALL_META)
    times = median_seconds(
        {
            "ours": ours(SMALL_META),
            "plain": lambda: msgpack.unpackb(msgpack.packb(SMALL_META)),
            "pickle": pickle5(SMALL_META),
        },
        0.5,
        21,
    )
    t_ours, t_plain, t_pickle = times["ours"], times["plain"], times["pickle"]
    print(
        f"\nmetadata-only dict ({len(packed)} B as msgpack): zmq_omni {t_ours * 1e6:.2f} us, "
        f"msgpack packb+unpackb {t_plain * 1e6:.2f} us, pickle5 {t_pickle * 1e6:.2f} us; "
        f"zmq_omni/msgpack = {t_ours / t_plain:.2f}x"
    )


def fresh_shapes() -> None:
    """The 1 MiB row again with a shape the codec has not seen: its descriptor memos miss on every call."""
    base = np.zeros(MIB // 4, np.float32)
    # More distinct shapes than the memos hold, visited in a cycle, so every call misses.
    payloads = [{"request_id": "chatcmpl-4f9a2c1e-0001", "hidden_states": base[: base.size - i]} for i in range(4096)]
    cycle = itertools.cycle(payloads)
    dst = np.empty_like(base)
    times = median_seconds({"ours": lambda: decode(encode(next(cycle))), "copy": memcpy(dst, base)}, 0.5, 21)
    print(
        f"\n~1 MiB array with a new shape every call (descriptor memos miss): zmq_omni {times['ours'] * 1e6:.2f} us, "
        f"memcpy {times['copy'] * 1e6:.2f} us, ours/memcpy = {times['ours'] / times['copy']:.2%}"
    )


def threshold_sweep() -> None:
    """Encode, send over ipc, receive and decode one array inline versus out of band."""
    print("inline vs out-of-band frame, encode + send + recv + decode over ipc:// PAIR; microseconds\n")
    print(f"{'array bytes':>12} {'inline':>10} {'own frame':>10} {'inline/own':>11}")
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="zomni-bench-") as tmp:
        a = ctx.socket(zmq.PAIR)
        b = ctx.socket(zmq.PAIR)
        try:
            endpoint = f"ipc://{os.path.join(tmp, 'sweep')}"
            a.bind(endpoint)
            b.connect(endpoint)

            def trip(payload: Any, threshold: int) -> Callable[[], Any]:
                def run() -> Any:
                    a.send_multipart(encode(payload, inline_threshold=threshold), copy=False)
                    return decode(b.recv_multipart(copy=False))

                return run

            rows = []
            for size in [256, 1 * KIB, 4 * KIB, 8 * KIB, 16 * KIB, 32 * KIB, 64 * KIB, 128 * KIB, 256 * KIB]:
                payload = {"request_id": "r-1", "x": np.ones(size, np.uint8)}
                times = median_seconds({"inline": trip(payload, size + 1), "frame": trip(payload, 0)}, 0.4, 9)
                t_inline, t_frame = times["inline"], times["frame"]
                rows.append((size, t_frame < t_inline))
                print(f"{size:>12} {t_inline * 1e6:10.2f} {t_frame * 1e6:10.2f} {t_inline / t_frame:10.2f}x")
            # The crossover is the smallest size from which the own frame wins at every larger size,
            # so one noisy row on a shared machine does not move it.
            crossover = next((size for i, (size, _) in enumerate(rows) if all(w for _, w in rows[i:])), None)
            print(f"\nown frame faster from {crossover} B on (DEFAULT_INLINE_THRESHOLD = {DEFAULT_INLINE_THRESHOLD})")
        finally:
            a.close(linger=0)
            b.close(linger=0)
            ctx.term()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--threshold", action="store_true", help="measure the inline-threshold crossover instead")
    args = parser.parse_args()
    if args.threshold:
        threshold_sweep()
    else:
        codec_table()


if __name__ == "__main__":
    main()

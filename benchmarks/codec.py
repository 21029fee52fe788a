"""Wire codec benchmark: zmq_omni.wire against pickle-5 and msgpack, plus one memcpy as reference.

Run as a script (not a test)::

    python benchmarks/codec.py              # the codec table (~30-60 s)
    python benchmarks/codec.py --threshold  # the inline-threshold crossover over a real socket

Every figure is the median per-call time over many timed batches of
encode+decode (after a warm-up call). The contenders of a row are measured
interleaved, batch by batch, so a noisy neighbour slows all of them alike and
the ratios hold on a busy machine even when the absolute times do not.
The measurement code is ``zmq_omni.bench.codec``; this script prints its rows.
"""

from __future__ import annotations

import argparse

import msgpack

from zmq_omni.bench import size_label
from zmq_omni.bench.codec import (
    SIZES,
    SMALL_META,
    CodecRow,
    ThresholdRow,
    run_codec,
    run_fresh_shapes,
    run_small_dict,
    run_struct_payloads,
    run_threshold_sweep,
)
from zmq_omni.wire import DEFAULT_INLINE_THRESHOLD


def fmt_us(seconds: float) -> str:
    return f"{seconds * 1e6:12.2f}"


def print_row(row: CodecRow) -> None:
    print(
        f"{size_label(row.size):>10} {fmt_us(row.ours)} {fmt_us(row.pickle5)} {fmt_us(row.msgpack_copy)} "
        f"{fmt_us(row.memcpy)} {row.ours / row.memcpy:11.2%} {row.pickle5 / row.ours:11.2f}x "
        f"{row.msgpack_copy / row.ours:12.2f}x",
        flush=True,
    )


def codec_table() -> None:
    print(f"zmq_omni.wire codec benchmark (inline threshold {DEFAULT_INLINE_THRESHOLD} B); times in microseconds")
    print("encode+decode of a dict {request_id, array}; memcpy = np.copyto of the array into a preallocated one\n")
    header = (
        f"{'payload':>10} {'zmq_omni':>12} {'pickle5-oob':>12} {'msgpack-copy':>12} {'memcpy':>12} "
        f"{'ours/memcpy':>12} {'pickle/ours':>12} {'msgpack/ours':>13}"
    )
    print(header)
    print("-" * len(header))
    # More, shorter batches for small sizes; the large rows are few calls per batch anyway.
    run_codec(SIZES, budget_s=0.5, repeats=21, large_budget_s=1.0, large_repeats=7, on_row=print_row)
    fresh = run_fresh_shapes(budget_s=0.5, repeats=21)
    print(
        f"\n~1 MiB array with a new shape every call (descriptor memos miss): zmq_omni {fresh.ours * 1e6:.2f} us, "
        f"memcpy {fresh.memcpy * 1e6:.2f} us, ours/memcpy = {fresh.ours / fresh.memcpy:.2%}"
    )
    small = run_small_dict(budget_s=0.5, repeats=21)
    print(
        f"\nmetadata-only dict ({len(msgpack.packb(SMALL_META))} B as msgpack): zmq_omni {small.ours * 1e6:.2f} us, "
        f"msgpack packb+unpackb {small.msgpack * 1e6:.2f} us, pickle5 {small.pickle5 * 1e6:.2f} us; "
        f"zmq_omni/msgpack = {small.ours / small.msgpack:.2f}x"
    )
    try:
        structs = run_struct_payloads(budget_s=0.5, repeats=21)
    except ImportError as exc:
        print(f"\nvllm-omni payload Structs: skipped: {exc}")
        return
    print(
        "\nvllm-omni main's payload Structs (OmniPayloadStruct, bf16 torch tensors), encode+decode, microseconds;"
        "\nmsgspec-bytes = msgspec msgpack of the same Structs with each tensor as its bytes; main = its serializer\n"
    )
    print(f"{'payload':>14} {'zmq_omni':>10} {'msgspec-bytes':>14} {'main':>10} {'ours/msgspec':>13} {'main/ours':>10}")
    for row in structs:
        print(
            f"{row.payload:>14} {row.ours * 1e6:10.2f} {row.msgspec_bytes * 1e6:14.2f} "
            f"{row.main_serializer * 1e6:10.2f} {row.ours / row.msgspec_bytes:12.2f}x "
            f"{row.main_serializer / row.ours:9.2f}x"
        )


def threshold_sweep() -> None:
    print("inline vs out-of-band frame, encode + send + recv + decode over ipc:// PAIR; microseconds\n")
    print(f"{'array bytes':>12} {'inline':>10} {'own frame':>10} {'inline/own':>11}")

    def print_sweep(row: ThresholdRow) -> None:
        print(
            f"{row.size:>12} {row.inline * 1e6:10.2f} {row.own_frame * 1e6:10.2f} {row.inline / row.own_frame:10.2f}x",
            flush=True,
        )

    rows = run_threshold_sweep(budget_s=0.4, repeats=9, on_row=print_sweep)
    # The crossover is the smallest size from which the own frame wins at every larger size,
    # so one noisy row on a shared machine does not move it.
    wins = [(row.size, row.own_frame < row.inline) for row in rows]
    crossover = next((size for i, (size, _) in enumerate(wins) if all(w for _, w in wins[i:])), None)
    print(f"\nown frame faster from {crossover} B on (DEFAULT_INLINE_THRESHOLD = {DEFAULT_INLINE_THRESHOLD})")


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

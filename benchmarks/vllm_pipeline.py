"""vllm-omni's Qwen3-Omni pipeline with main's call patterns: ZmqConnector against main's SharedMemoryConnector.

Run as a script (not a test)::

    python benchmarks/vllm_pipeline.py                 # 3 repetitions, all four backends (~1-2 min)
    python benchmarks/vllm_pipeline.py --repeats 1 --backends main-shm,push-ipc

Three stage processes per backend (thinker -> talker -> code2wav), main's save
thread and 1 ms polling receive loop, main's msgspec payload Structs with
torch tensors, every chunk's values checked where it arrives. The baseline is
main's SharedMemoryConnector restated; ratios are against it, measured in the
same run. Needs torch and msgspec (``pip install 'zmq-omni[torch,payloads]'``).
The measurement code, and what each figure means, is
``zmq_omni.bench.vllm_pipeline``; this script prints its rows.
"""

from __future__ import annotations

import argparse
import sys

from zmq_omni.bench.vllm_pipeline import BACKENDS, BASELINE, INSTALL_HINT, missing_dependencies, run_vllm_pipeline


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.2f}"


def us(seconds: float) -> str:
    return f"{seconds * 1e6:8.0f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--backends", default=",".join(BACKENDS), help=f"comma-separated, from {list(BACKENDS)}")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions (medians over them)")
    parser.add_argument("--paced-requests", type=int, default=4, help="paced requests per repetition")
    parser.add_argument("--paced-chunks", type=int, default=25, help="chunks per paced request")
    parser.add_argument("--pace-ms", type=float, default=20.0, help="ms between the thinker's chunks, paced")
    parser.add_argument("--requests", type=int, default=8, help="concurrent requests, throughput workload")
    parser.add_argument("--chunks", type=int, default=50, help="chunks per request, throughput workload")
    args = parser.parse_args()
    missing = missing_dependencies()
    if missing:
        print(f"vllm_pipeline.py: needs {' and '.join(missing)}: {INSTALL_HINT}", file=sys.stderr)
        return 2
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    print(
        f"vllm-omni pipeline benchmark: {len(backends)} backends x 3 stage processes; {args.repeats} repetitions; "
        f"paced: {args.paced_requests} x 1 request x {args.paced_chunks} chunks every {args.pace_ms:g} ms; "
        f"throughput: {args.requests} requests x {args.chunks} chunks",
        flush=True,
    )
    try:
        result = run_vllm_pipeline(
            backends,
            repeats=args.repeats,
            paced_requests=args.paced_requests,
            paced_chunks=args.paced_chunks,
            pace_s=args.pace_ms / 1e3,
            requests=args.requests,
            chunks=args.chunks,
            on_progress=lambda line: print(f"  {line}", flush=True),
        )
    except RuntimeError as exc:
        print(f"vllm_pipeline.py: FAILED: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the stage processes are stopped and their segments removed by now
        print("vllm_pipeline.py: interrupted", file=sys.stderr)
        return 130
    print(f"\nevery chunk checked where it arrived ({result.checked_chunks} chunk arrivals); medians of repetitions\n")
    header = (
        f"{'backend':<42} {'chunk0 ms':>9} {'p50 ms':>8} {'p99 ms':>8} {'chunks/s':>9} "
        f"{'put4K p50 us':>12} {'p99 us':>8} {'put1M us':>8} {'hop1 ms':>8} {'cold0 ms':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in result.rows:
        print(
            f"{r.label:<42} {ms(r.chunk0):>9} {ms(r.chunk_p50)} {ms(r.chunk_p99)} {r.chunks_per_s:9.0f} "
            f"{us(r.put_small_p50):>12} {us(r.put_small_p99)} {us(r.put_chunk0_p50)} {ms(r.hop1_p50)} "
            f"{ms(r.cold_chunk0)}"
        )
    if BASELINE in backends:
        base = result.row(BASELINE)
        print(f"\nratios against {BACKENDS[BASELINE]} (> 1: better than it; times: its / ours, rate: ours / its)\n")
        print(f"{'backend':<42} {'chunk0':>8} {'p50':>8} {'p99':>8} {'chunks/s':>9} {'put4K p50':>10}")
        for r in result.rows:
            if r.backend == BASELINE:
                continue
            print(
                f"{r.label:<42} {base.chunk0 / r.chunk0:7.2f}x {base.chunk_p50 / r.chunk_p50:7.2f}x "
                f"{base.chunk_p99 / r.chunk_p99:7.2f}x {r.chunks_per_s / base.chunks_per_s:8.2f}x "
                f"{base.put_small_p50 / r.put_small_p50:9.2f}x"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Adapter overheads: how long the scheduler thread is held, and chunk latency vs raw ZmqConnector.

Run: python benchmarks/adapters.py [--n 2000]

Two ZmqConnectors (stage 0 sender, stage 1 receiver) in one process over ipc://
in a temp dir. Prints p50/p99 of:
  * save_async / load_async / process_pending_chunks(+restore_queues) call time
    on the calling (scheduler) thread, beside a synchronous ZmqConnector put;
  * chunk latency save_async -> assembled input taken on the receiver, beside a
    raw ZmqConnector put -> get_with_deadline of the same payload;
  * receive-worker CPU with nothing pending and with 64 loads pending (no data).
The measurement code is ``zmq_omni.bench.adapters``; this script prints its figures.
"""

from __future__ import annotations

import argparse

from zmq_omni.bench.adapters import Percentiles, run_adapters


def pct(p: Percentiles) -> str:
    return f"p50 {p.p50 * 1e6:8.1f} us   p99 {p.p99 * 1e6:8.1f} us"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2000, help="samples per measurement")
    parser.add_argument("--payload", type=int, default=4096, help="bytes of array per chunk")
    args = parser.parse_args()
    n = args.n
    print(f"adapters benchmark: n={n}, payload {args.payload} B array + metadata, ZmqConnector ipc://")
    r = run_adapters(n, args.payload, cpu_window_s=1.0)
    print(f"  save_async hold (1 in flight)    {pct(r.save_hold)}")
    print(f"  save_async hold (burst of {n})  {pct(r.save_burst)}")
    print(f"  load_async hold                  {pct(r.load_hold)}")
    print(f"  process_pending_chunks (64 req)  {pct(r.pending_hooks)}")
    print(f"  restore_queues (64 req)          {pct(r.restore)}")
    print(f"  sync ZmqConnector put (hold)     {pct(r.raw_put)}")
    print(f"  raw ZmqConnector put->get        {pct(r.raw_put_get)}")
    print(f"  chunk save_async->assembled      {pct(r.chunk_latency)}")
    lat, raw = r.chunk_latency, r.raw_put_get
    print(f"  ratio chunk/raw latency          p50 {lat.p50 / raw.p50:.2f}x   p99 {lat.p99 / raw.p99:.2f}x")
    assert r.pending_cpu is not None and r.idle_cpu is not None
    print(
        f"  recv worker CPU: 64 loads pending, no data {r.pending_cpu * 100:.2f}% of a core;"
        f" idle {r.idle_cpu * 100:.3f}%"
    )


if __name__ == "__main__":
    main()

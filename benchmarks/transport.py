"""ZmqConnector put->get throughput and small-message rate beside raw pyzmq, measured in one run.

Run: ``python benchmarks/transport.py`` (about a minute and a half on 2 cores).
``--quick`` halves the message counts. What each cell measures, and how, is
written in ``zmq_omni.bench.transport`` (the measurement code); this script
prints its rows.
"""

from __future__ import annotations

import argparse
import time

import zmq

from zmq_omni.bench import size_label
from zmq_omni.bench.transport import SIZES, SMALL, RateRow, ThroughputRow, run_transport

MiB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="half the message counts")
    args = parser.parse_args()
    started = time.perf_counter()
    print(f"pyzmq {zmq.__version__}, libzmq {zmq.zmq_version()}; GB/s = 1e9 bytes/s")
    ratios = f"{'off/raw':>8} {'auto/raw':>9}"
    print(f"{'transport':<9} {'size':>8} {'n':>6} {'raw GB/s':>9} {'shm:off':>8} {'shm:auto':>9} {ratios}")

    def print_row(row: ThroughputRow | RateRow) -> None:
        if isinstance(row, RateRow):
            print(f"{row.transport}: shm:auto sender health: shm_puts={row.auto_shm_puts}", flush=True)
            return
        raw, off, auto = row.raw / 1e9, row.off / 1e9, row.auto / 1e9
        print(
            f"{row.transport:<9} {size_label(row.size):>8} {row.count:>6} {raw:>9.2f} {off:>8.2f} {auto:>9.2f} "
            f"{off / raw:>7.2f}x {auto / raw:>8.2f}x",
            flush=True,
        )

    result = run_transport(
        SIZES,
        transports=("tcp", "ipc"),
        budget_bytes=(384 if args.quick else 768) * MiB,
        max_count=10_000 if args.quick else 20_000,
        small_count=20_000 if args.quick else 40_000,
        on_row=print_row,
    )
    print(f"\nsmall messages ({SMALL} B payload, all in flight; raw = PUSH/PULL + msgpack per message)")
    print(f"{'transport':<9} {'n':>6} {'raw msg/s':>10} {'shm:off':>9} {'shm:auto':>9} {ratios}")
    for rate in result.small:
        print(
            f"{rate.transport:<9} {rate.count:>6} {rate.raw:>10,.0f} {rate.off:>9,.0f} {rate.auto:>9,.0f} "
            f"{rate.off / rate.raw:>7.2f}x {rate.auto / rate.raw:>8.2f}x"
        )
    print(f"\ntotal time {time.perf_counter() - started:.1f}s")


if __name__ == "__main__":
    main()

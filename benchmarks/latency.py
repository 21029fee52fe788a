"""Round trip of one message in flight between two processes: ZmqConnector beside raw pyzmq, p50 and p99.

Run: ``python benchmarks/latency.py`` (about half a minute on 2 cores);
``--runs 3`` repeats the whole grid; ``--pin same --pin split`` runs it with both
processes on one CPU and then on two (the placement decides the figure, raw
pyzmq's too; with ``off``, the default, the last column says how often each echo
had last run on our CPU). What each cell measures, and how, is
written in ``zmq_omni.bench.latency`` (the measurement code); this script
prints its rows.
"""

from __future__ import annotations

import argparse
import time

import zmq

from zmq_omni.bench import size_label
from zmq_omni.bench.latency import LATENCY_SIZES, PLACEMENTS, LatencyRow, run_latency


def _print(row: LatencyRow) -> None:
    print(
        f"{row.transport:<9} {size_label(row.size):>8} {row.count:>6} "
        f"{row.raw_p50 * 1e6:>8.0f} {row.raw_p99 * 1e6:>8.0f} {row.omni_p50 * 1e6:>9.0f} {row.omni_p99 * 1e6:>9.0f} "
        f"{row.omni_p50 / row.raw_p50:>8.2f}x {row.omni_p99 / row.raw_p99:>8.2f}x  {row.placement}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1, help="repeat the whole grid this many times")
    parser.add_argument("--count", type=int, default=2000, help="round trips timed per cell and contender")
    parser.add_argument("--transport", action="append", choices=("ipc", "tcp"), help="default: both")
    parser.add_argument("--shm", default="off", choices=("off", "auto"), help="the connectors' shm policy")
    parser.add_argument(
        "--pin", action="append", choices=PLACEMENTS, help="CPU placement of the two processes (default: off)"
    )
    args = parser.parse_args()
    print(f"pyzmq {zmq.__version__}, libzmq {zmq.zmq_version()}; RTT in microseconds, one message in flight")
    for run in range(1, args.runs + 1):
        for pin in args.pin or ["off"]:
            started = time.perf_counter()
            print(
                f"\nrun {run}: {'transport':<9} {'size':>8} {'n':>6} {'raw p50':>8} {'raw p99':>8} "
                f"{'omni p50':>9} {'omni p99':>9} {'p50 ratio':>9} {'p99 ratio':>9}  placement"
            )
            transports = args.transport or ("ipc", "tcp")
            run_latency(LATENCY_SIZES, transports=transports, count=args.count, shm=args.shm, pin=pin, on_row=_print)
            print(f"({time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()

"""Shared-memory transfer benchmark: put->get time per payload size, with ratios, in one run.

Run:  python benchmarks/shm.py [--sizes 1K,64K,1M,16M,64M,256M] [--budget-mib 768]

Every row is the median over repetitions of one put->get of a dict holding one
float32 array of the given size, sender and receiver in this process (the data
path -- copies and page faults -- is the same across processes; only wake-ups
differ, and those are measured by the tests, not here). Paths:

* memcpy      -- one ``np.copyto`` into a pre-faulted buffer: the floor.
* zmq-ipc     -- raw pyzmq PUSH->PULL over ``ipc://`` with ``copy=False``.
* zmq-tcp     -- the same over ``tcp://127.0.0.1``.
* vllm-style  -- vllm-omni's shared-memory IPC path as its current code does
                 it: pickle -> magic/length/CRC-32 header prepended -> a new
                 segment -> copy out -> unlink -> header stripped, CRC
                 checked -> unpickle.
* pickle-shm  -- the same without the framing: pickle -> a new segment ->
                 copy out -> unlink -> unpickle.
* shm-conn    -- our SharedMemoryConnector (mailbox record + reused slot,
                 zero-copy lease on the receiver).
* zmq+slot    -- the handle-over-ZeroMQ design of ZmqConnector's fast path on
                 raw pyzmq: SlotPool.write -> send the packed SlotHandle over
                 ipc -> SlotReader.open -> wire.decode.
* zmq-off     -- ZmqConnector push mode over ``ipc://`` with ``shm: off``
                 (ordinary frames, copy=False; the small-message baseline).
* zmq-conn    -- ZmqConnector with ``shm: on``: its same-host fast path for
                 payloads >= ``shm_threshold`` (512 KiB), frames below it.
* zmq-pull    -- ZmqConnector in pull mode with ``shm: on``: put, then get with
                 put's metadata (the server copies into a slot at fetch time).

The measurement code is ``zmq_omni.bench.shm``; this script prints its rows.
"""

from __future__ import annotations

import argparse
import os

from zmq_omni.bench import parse_size, size_label
from zmq_omni.bench.shm import PATHS, ShmRow, run_shm


def print_row(row: ShmRow) -> None:
    t = row.times
    cells = " ".join(f"{t[path] * 1e3:>10.3f}" for path in PATHS)
    best = t["zmq-conn"]
    ratios = (
        f"conn/off {best / t['zmq-off']:.2f}x  "
        f"fast/memcpy {best / t['memcpy']:.2f}x  "
        f"vllm/fast {t['vllm-style'] / best:.1f}x  "
        f"pickle-shm/fast {t['pickle-shm'] / best:.1f}x  "
        f"tcp/fast {t['zmq-tcp'] / best:.1f}x  "
        f"ipc/shm-conn {t['zmq-ipc'] / t['shm-conn']:.2f}x  "
        f"vllm/shm-conn {t['vllm-style'] / t['shm-conn']:.1f}x  "
        f"vllm/pull {t['vllm-style'] / t['zmq-pull']:.1f}x"
    )
    print(f"{size_label(row.size):>9} {cells}   {ratios}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1K,64K,1M,16M,64M,256M")
    parser.add_argument("--budget-mib", type=int, default=768, help="bytes moved per path and size")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    print(f"put->get median, ms (pid {os.getpid()}, {os.cpu_count()} cpus)")
    print(f"{'size':>9} " + " ".join(f"{c:>10}" for c in PATHS) + "   ratios")
    run_shm(sizes, budget_bytes=args.budget_mib << 20, on_row=print_row)
    print("fast = zmq-conn (ZmqConnector, shm: on); conn/off < 1 means the shm machinery is not slower.")


if __name__ == "__main__":
    main()

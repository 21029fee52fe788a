"""The CUDA cases of the payload codec, for a GPU machine: run once, keep the output (a minute or two).

    python benchmarks/cuda_check.py            # checks + a short staging measurement
    python benchmarks/cuda_check.py --no-pytest

It fails (exit status 1) when torch sees no GPU, so it cannot pass by skipping. Steps:

1. the CUDA tests of ``tests/test_wire_payloads.py`` (pytest ``-k cuda``), with
   ``CUDA_VISIBLE_DEVICES`` as given (they fail, not skip, when it names a GPU torch cannot use);
2. CUDA tensors of every wire dtype and awkward layout (strided, zero-size, 0-d, bfloat16) encoded,
   decoded on the CPU and with ``device="cuda"``, bit-exact;
3. the pinned staging pool: buffers are pinned, reused across puts, and never reused while a frame
   still views them (the put's frames are held while the same-size tensor is encoded again);
4. ZmqConnector push over ipc with ``shm: on``, sender and receiver in this process, a payload of CUDA
   tensors, the receiver configured with ``decode_device: cuda``;
5. device-to-host staging time against ``tensor.cpu()`` for 1, 16 and 256 MiB (median of 9; no
   thresholds, only numbers to report).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.wire import _staging, decode, encode, resolve_device

ROOT = Path(__file__).resolve().parents[1]
DTYPES = ["float32", "float64", "float16", "bfloat16", "complex64", "int8", "int16", "int32", "int64", "uint8",
          "bool"]  # fmt: skip


def tensor_bytes(t: Any) -> bytes:
    return bytes(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def address(frame: Any) -> int:
    return int(np.frombuffer(frame, np.uint8).ctypes.data)


def cases() -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    out: dict[str, Any] = {}
    for name in DTYPES:
        base = torch.randn(257, 129, device="cuda", generator=gen) * 100
        out[name] = base.to(getattr(torch, name))
    out["strided"] = torch.randn(512, 512, device="cuda", generator=gen).t()[::3]
    out["empty"] = torch.zeros(0, 7, device="cuda")
    out["scalar_bf16"] = torch.tensor(1.25, device="cuda", dtype=torch.bfloat16)
    out["big_bf16"] = torch.randn(4096, 1024, device="cuda", generator=gen).to(torch.bfloat16)  # 8 MiB
    return out


def check(condition: bool, what: str) -> None:
    print(("ok   " if condition else "FAIL ") + what, flush=True)
    if not condition:
        raise SystemExit(1)


def step_codec() -> None:
    tensors = cases()
    for threshold in (0, 16 << 10):
        frames = encode(tensors, inline_threshold=threshold)
        on_cpu = decode([bytes(f) for f in frames])
        on_gpu = decode(frames, device=resolve_device("cuda"))
        for name, t in tensors.items():
            check(
                on_cpu[name].device.type == "cpu"
                and tensor_bytes(on_cpu[name]) == tensor_bytes(t)
                and on_cpu[name].shape == t.shape
                and on_cpu[name].dtype == t.dtype,
                f"codec {name} threshold={threshold} -> cpu",
            )
            check(
                on_gpu[name].device.type == "cuda" and tensor_bytes(on_gpu[name]) == tensor_bytes(t),
                f"codec {name} threshold={threshold} -> cuda",
            )


def step_pool() -> None:
    pool = _staging._pools.get(True)
    check(pool is not None and pool.pin, "CUDA tensors staged through the pinned pool")
    assert pool is not None
    t, t2 = torch.randn(1 << 20, device="cuda"), torch.randn(1 << 20, device="cuda")  # 4 MiB each
    held = encode({"t": t})
    second = encode({"t": t2})
    check(address(held[1]) != address(second[1]), "a buffer still viewed by a frame is not reused")
    check(bytes(held[1]) == tensor_bytes(t), "the held frame still holds the first tensor's bytes")
    freed = address(second[1])
    del second
    gc.collect()
    reused = pool.reused
    third = encode({"t": t2})
    check(pool.reused == reused + 1 and address(third[1]) == freed, "a released buffer is reused")
    del held, third
    check(bool(torch.empty(1, pin_memory=True).is_pinned()), "pinned allocations work here")


def step_connector() -> None:
    with (
        tempfile.TemporaryDirectory(prefix="zo-", dir="/tmp") as tmp,
        tempfile.TemporaryDirectory(prefix="zc-", dir="/dev/shm") as shm,
    ):
        base = {"endpoints": {"1": f"ipc://{tmp}/r1"}, "shm_dir": shm, "shm_min_free_bytes": 0}
        with (
            ZmqConnector({**base, "stage_id": "1", "role": "receiver", "decode_device": "cuda"}) as receiver,
            ZmqConnector({**base, "stage_id": "0", "role": "sender", "shm": "on"}) as sender,
        ):
            tensors = cases()
            ok, nbytes, _ = sender.put("0", "1", "k", {"tensors": tensors, "meta": ("r1", slice(0, 4))})
            check(ok, f"put of CUDA tensors ({nbytes} bytes)")
            got = receiver.get_with_deadline("0", "1", "k", deadline=time.monotonic() + 30)
            check(got is not None, f"get ({receiver.drain_failures()})")
            assert got is not None
            for name, t in tensors.items():
                check(
                    got[0]["tensors"][name].device.type == "cuda"
                    and tensor_bytes(got[0]["tensors"][name]) == tensor_bytes(t),
                    f"connector {name}",
                )
            check(got[0]["meta"] == ("r1", slice(0, 4)), "connector metadata")
            check(sender.health()["shm_puts"] >= 1, "the payload took shared memory")


def step_timing() -> None:
    print("\nstaging (encode of one CUDA tensor: D2H into the pinned pool) vs tensor.cpu(); ms, median of 9")
    for mib in (1, 16, 256):
        t = torch.randn(mib << 18, device="cuda")
        samples: dict[str, list[float]] = {"encode": [], "cpu()": []}
        for _ in range(9):
            torch.cuda.synchronize()
            start = time.perf_counter()
            frames = encode(t)
            samples["encode"].append(time.perf_counter() - start)
            del frames
            start = time.perf_counter()
            host = t.cpu()
            samples["cpu()"].append(time.perf_counter() - start)
            del host
        enc, cpu = (statistics.median(samples[k]) * 1e3 for k in ("encode", "cpu()"))
        print(f"{mib:>5} MiB  encode {enc:8.3f}  cpu() {cpu:8.3f}  ({mib / 1024 / (enc / 1e3):.1f} GiB/s staged)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--no-pytest", action="store_true", help="skip step 1")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, numpy {np.__version__}, cuda available: {torch.cuda.is_available()}")
    check(torch.cuda.is_available(), "torch sees a GPU")
    print(f"device: {torch.cuda.get_device_name(0)}")
    if not args.no_pytest:
        rc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "tests/test_wire_payloads.py",
                "-k",
                "cuda",
                "-v",
                "-p",
                "no:cacheprovider",
            ],
            cwd=ROOT,
            check=False,
        ).returncode
        check(rc == 0, "pytest -k cuda tests/test_wire_payloads.py")
    step_codec()
    step_pool()
    step_connector()
    step_timing()
    print("\nall CUDA checks passed")


if __name__ == "__main__":
    main()

"""``zmq-omni bench`` and the benchmark grids run and report; speed is never asserted here."""

from __future__ import annotations

import importlib.util
import logging
import math
import multiprocessing
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from zmq_omni.bench import Comparison, parse_size, size_label
from zmq_omni.bench.adapters import run_adapters
from zmq_omni.bench.codec import run_struct_payloads
from zmq_omni.bench.latency import run_latency
from zmq_omni.bench.vllm_pipeline import BACKENDS, INSTALL_HINT, missing_dependencies, run_vllm_pipeline
from zmq_omni.cli import _bench

ROOT = Path(__file__).resolve().parent.parent
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _run(*args: str, timeout: float = 100) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False)


def test_bench_quick_prints_one_table_with_a_row_per_grid(tmp_path: Path) -> None:
    plot = tmp_path / "bench.png"
    result = _run(sys.executable, "-m", "zmq_omni.cli", "bench", "--quick", "--plot", str(plot))
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "benchmark" in out and "baseline name" in out and "ratio" in out
    for row in (
        "wire codec encode+decode",
        "ZmqConnector ipc shm=off",
        "ZmqConnector ipc rate",
        "ZmqConnector ipc RTT p50",
        "ZmqConnector ipc RTT p99",
        "the ipc 1 KiB round trip above: placement off, same CPU ",
        "shm fast path",
        "save_async scheduler hold",
        "chunk save_async->assembled",
        *(() if missing_dependencies() else ("wire codec, payload Struct", "vllm pipeline push-ipc")),
    ):
        assert row in out, row
    assert "total time" in out
    assert "WARNING" not in result.stderr and "WARNING" not in out, result.stderr
    if importlib.util.find_spec("matplotlib") is None:
        assert "zmq-omni[plot]" in out
        assert not plot.exists()
    else:
        assert plot.read_bytes()[:8] == PNG_SIGNATURE
        assert f"plot written to {plot}" in out


def test_the_adapters_grid_shuts_its_adapters_down_with_nothing_left_to_send(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The grid's last save_async burst must be sent before the adapters shut down: a chunk
    # still queued at shutdown is a send failure, logged as a WARNING in the middle of the table.
    with caplog.at_level(logging.WARNING, logger="zmq_omni"):
        result = run_adapters(200, 4096, cpu_window_s=0)
    assert result.n == 200
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_no_plot_writes_nothing(tmp_path: Path) -> None:
    result = _run(sys.executable, "-m", "zmq_omni.cli", "bench", "--quick", "--no-plot")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "plot" not in result.stdout.split("total time")[1]


def test_without_matplotlib_the_plot_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    plot = tmp_path / "bench.png"
    _bench._plot([Comparison("codec", "x", "1 KiB", 1.0, 2.0, "y")], str(plot))
    assert "pip install 'zmq-omni[plot]'" in capsys.readouterr().out
    assert not plot.exists()


def test_ratio_is_how_many_times_better_ours_is_for_times_and_rates() -> None:
    assert Comparison("g", "b", "s", ours=1.0, baseline=4.0, baseline_name="n").ratio == 4.0
    assert Comparison("g", "b", "s", ours=3e9, baseline=1e9, baseline_name="n", unit="B/s").ratio == 3.0
    assert Comparison("g", "b", "s", ours=1e5, baseline=4e5, baseline_name="n", unit="msg/s").ratio == 0.25


def test_sizes_parse_and_print() -> None:
    assert [parse_size(s) for s in ("1K", "64KiB", "1M", "256M", "4096")] == [1024, 65536, 1 << 20, 256 << 20, 4096]
    assert [size_label(n) for n in (200, 1024, 1 << 20, 256 << 20)] == ["200 B", "1 KiB", "1 MiB", "256 MiB"]


def test_benchmark_scripts_stay_runnable_as_thin_wrappers() -> None:
    shm = _run(sys.executable, "benchmarks/shm.py", "--sizes", "1K,1M", "--budget-mib", "1")
    assert shm.returncode == 0, shm.stderr
    assert "zmq-conn" in shm.stdout and "1 MiB" in shm.stdout and "vllm/fast" in shm.stdout
    adapters = _run(sys.executable, "benchmarks/adapters.py", "--n", "50")
    assert adapters.returncode == 0, adapters.stderr
    assert "chunk save_async->assembled" in adapters.stdout and "recv worker CPU" in adapters.stdout
    latency = _run(sys.executable, "benchmarks/latency.py", "--count", "50", "--transport", "ipc", "--pin", "same")
    assert latency.returncode == 0, latency.stderr
    assert "1 MiB" in latency.stdout and "p99 ratio" in latency.stdout and "same, same CPU" in latency.stdout
    aio = _run(sys.executable, "benchmarks/aio.py", "--rounds", "1", "--trips", "100", "--messages", "300")
    assert aio.returncode == 0, aio.stderr
    for row in ("async asyncio", "raw pyzmq, blocking", "async asyncio, all 300 waiting", "the loop alone takes"):
        assert row in aio.stdout, aio.stdout


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="split placement needs two CPUs")
def test_latency_runs_both_processes_where_pinned_and_gives_this_process_its_cpus_back() -> None:
    before = os.sched_getaffinity(0)
    seen = {}
    for pin in ("same", "split", "off"):
        rows = run_latency([1024], transports=("ipc",), count=20, warmup=2, rounds=2, pin=pin)
        assert os.sched_getaffinity(0) == before
        assert all(os.sched_getaffinity(int(tid)) == before for tid in os.listdir("/proc/self/task"))
        seen[pin] = rows[0].placement
    # Observed after each round: where the echo last ran against where this process runs.
    assert seen["same"] == "same, same CPU raw 2/2 omni 2/2", seen
    assert seen["split"] == "split, same CPU raw 0/2 omni 0/2", seen
    assert re.fullmatch(r"off, same CPU raw [012]/2 omni [012]/2", seen["off"]), seen
    with pytest.raises(ValueError, match="pin must be one of"):
        run_latency([1024], transports=("ipc",), pin="cpu0")


def test_the_plot_shows_what_a_user_compares_and_leaves_zero_copy_against_copy_to_the_table() -> None:
    cells = [
        Comparison("codec", "wire codec encode+decode", "64 MiB", 1e-5, 2.8e-5, "pickle5 out-of-band"),
        Comparison("codec", "wire codec encode+decode", "64 MiB", 1e-5, 0.29, "msgpack, array copied"),
        Comparison("codec", "wire codec encode+decode", "64 MiB", 1e-5, 0.011, "one memcpy of the array"),
        Comparison("codec", "wire codec encode+decode", "192 B dict", 9e-6, 7e-6, "msgpack packb+unpackb"),
        Comparison("transport", "ZmqConnector ipc shm=off", "1 MiB", 3e9, 3e9, "raw pyzmq PUSH/PULL copy=False", "B/s"),
        Comparison(
            "shm",
            "shm fast path (ZmqConnector ipc)",
            "64 MiB",
            0.013,
            0.24,
            "vllm-omni style: pickle+CRC framing+new segment",
        ),
        Comparison("shm", "shm fast path (ZmqConnector ipc)", "64 MiB", 0.013, 0.098, "raw pyzmq tcp copy=False"),
        Comparison("shm", "shm fast path (ZmqConnector ipc)", "64 MiB", 0.013, 0.014, "one memcpy of the payload"),
        Comparison("adapters", "save_async scheduler hold", "p50", 1e-5, 4e-5, "synchronous ZmqConnector put"),
    ]
    panels = _bench._plot_panels(cells)
    plotted = {c.baseline_name: title for title, rows in panels for c in rows}
    assert "msgpack, array copied" not in plotted and "one memcpy of the array" not in plotted
    assert len(plotted) == len(cells) - 2
    assert "raw pyzmq" in plotted["raw pyzmq PUSH/PULL copy=False"]
    assert "vllm-omni" in plotted["vllm-omni style: pickle+CRC framing+new segment"]
    assert "floor" in plotted["one memcpy of the payload"]
    assert len(panels) == 4
    latency = Comparison("latency", "ZmqConnector ipc RTT p50", "1 KiB", 2e-4, 6e-5, "raw pyzmq PAIR")
    titles = [title for title, rows in _bench._plot_panels([*cells, latency]) if latency in rows]
    assert len(titles) == 1 and "round trip" in titles[0]


def test_a_bad_plot_path_fails_before_the_benchmark_runs(tmp_path: Path) -> None:
    result = _run(
        sys.executable, "-m", "zmq_omni.cli", "bench", "--plot", str(tmp_path / "missing" / "x.png"), timeout=30
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"zmq-omni bench: configuration error: --plot {tmp_path / 'missing' / 'x.png'}: no such directory "
        f"'{tmp_path / 'missing'}'"
    ]
    assert "ratio" not in result.stdout  # no grid ran


# -- the vllm-omni pipeline grid and the codec's Struct rows -------------------------------------------------------
needs_payload_deps = pytest.mark.skipif(
    bool(missing_dependencies()), reason="the vllm pipeline grid needs torch and msgspec (zmq-omni[torch,payloads])"
)


def _bench_children() -> list[str]:
    return [p.name for p in multiprocessing.active_children() if p.name.startswith("bench-")]


@needs_payload_deps
def test_the_vllm_pipeline_runs_every_backend_and_every_chunk_arrives_right() -> None:
    result = run_vllm_pipeline(
        tuple(BACKENDS), repeats=1, paced_requests=1, paced_chunks=3, pace_s=0.005, requests=2, chunks=3
    )
    assert [r.backend for r in result.rows] == list(BACKENDS)
    # warm-up (1 x 3) + paced (1 x 3) + throughput (2 x 3) chunks, each checked at the talker and at code2wav
    assert result.checked_chunks == len(BACKENDS) * 2 * (3 + 3 + 6)
    for row in result.rows:
        figures = [row.chunk0, row.chunk_p50, row.chunk_p99, row.chunks_per_s, row.put_small_p50, row.cold_chunk0]
        assert all(math.isfinite(f) and f > 0 for f in figures), row
    cells = result.comparisons()
    assert len(cells) == 5 * (len(BACKENDS) - 1)
    assert {c.unit for c in cells} == {"s", "chunks/s"}
    assert all(c.baseline_name == "main's SharedMemoryConnector, restated" for c in cells)
    tag = result.settings["tag"]
    assert [name for name in os.listdir("/dev/shm") if tag in name] == []
    assert _bench_children() == []


@needs_payload_deps
def test_a_stage_that_misses_its_deadline_fails_the_run_with_every_stage_output_and_leaves_nothing() -> None:
    with pytest.raises(RuntimeError) as failed:
        run_vllm_pipeline(("main-shm",), repeats=1, paced_requests=1, paced_chunks=2, job_timeout_s=0.001)
    text = str(failed.value)
    assert "backend main-shm" in text and "in time" in text
    for stage in (0, 1, 2):
        assert f"--- main-shm stage {stage} ---" in text
    assert _bench_children() == []


@needs_payload_deps
def test_the_stage_checks_catch_a_wrong_value_a_wrong_request_and_a_wrong_flag() -> None:
    from zmq_omni.bench._vllm_stage import Payloads, PayloadShapes
    from zmq_omni.wire import decode, encode

    payloads = Payloads(PayloadShapes(prompt_len=8, hidden=64))
    for chunk in (0, 1):
        sent = payloads.thinker_chunk(3, 1, chunk, last=chunk == 1)
        got = decode(encode(sent))  # an unregistered Struct arrives as the dict main's receivers read
        assert payloads.check_thinker_chunk(got, 3, 1, chunk, last=chunk == 1) is None
        assert "tag" in str(payloads.check_thinker_chunk(got, 3, 2, chunk, last=chunk == 1))
        assert "meta.finished" in str(payloads.check_thinker_chunk(got, 3, 1, chunk, last=chunk != 1))
        assert "dict" in str(payloads.check_thinker_chunk(sent, 3, 1, chunk, last=chunk == 1))
    got = decode(encode(payloads.thinker_chunk(3, 1, 0, last=False)))
    got["embed"]["prefill"] = got["embed"]["prefill"].clone()
    got["embed"]["prefill"][5, 7] += 1
    assert "embed.prefill's values differ" in str(payloads.check_thinker_chunk(got, 3, 1, 0, last=False))
    codes = decode(encode(payloads.code2wav_chunk(3, 1, 2, last=True)))
    assert payloads.check_code2wav_chunk(codes, 3, 1, 2, last=True) is None
    assert codes["codes"]["audio"].numel() == 800 and codes["meta"]["left_context_size"] == 25
    codes["codes"]["audio"] = codes["codes"]["audio"].clone()
    codes["codes"]["audio"][-1] += 1
    assert "codes.audio differ" in str(payloads.check_code2wav_chunk(codes, 3, 1, 2, last=True))


@needs_payload_deps
def test_the_baseline_restates_main_shm_connector_and_leaves_no_segment_or_lock_file() -> None:
    from zmq_omni.bench._vllm_main import MainShmConnector
    from zmq_omni.bench._vllm_stage import Payloads, PayloadShapes

    payloads = Payloads(PayloadShapes(prompt_len=8, hidden=64))
    key = f"zobenchtest{os.getpid()}_0_0"
    sender, receiver = MainShmConnector({"stage_id": 0}), MainShmConnector({"stage_id": 1})
    try:
        assert receiver.get("0", "1", key) is None  # not there yet: None at once
        ok, size, meta = sender.put(
            from_stage="0", to_stage="1", put_key=key, data=payloads.thinker_chunk(1, 0, 0, False)
        )
        assert ok and size > 2 * 9 * 64 * 2 and meta is not None
        assert os.path.exists(f"/dev/shm/{key}") and os.path.exists(f"/dev/shm/shm_{key}_lockfile.lock")
        got = receiver.get("0", "1", key)
        assert got is not None and got[1] == size
        assert payloads.check_thinker_chunk(got[0], 1, 0, 0, last=False) is None
        assert receiver.get("0", "1", key) is None  # consumed: read, copied out, unlinked
        assert not os.path.exists(f"/dev/shm/{key}") and not os.path.exists(f"/dev/shm/shm_{key}_lockfile.lock")
    finally:
        sender.close()
        receiver.close()


@needs_payload_deps
def test_the_codec_struct_rows_run_against_msgspec_and_main_serializer() -> None:
    rows = run_struct_payloads(budget_s=0.02, repeats=3)
    assert [r.payload for r in rows] == ["4 KiB chunk", "1 MiB chunk0"]
    assert rows[0].tensor_bytes == 2048 * 2 + 2 and rows[1].tensor_bytes > 1 << 20
    for row in rows:
        assert min(row.ours, row.msgspec_bytes, row.main_serializer) > 0
        assert [c.baseline_name for c in row.comparisons()] == [
            "msgspec msgpack, tensors as bytes",
            "vllm-omni main's serializer",
        ]


def test_without_torch_the_pipeline_and_struct_rows_say_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # find_spec("torch") -> None
    assert "torch" in missing_dependencies()
    with pytest.raises(ImportError, match=re.escape(INSTALL_HINT)):
        run_vllm_pipeline(("main-shm",))
    with pytest.raises(ImportError, match=re.escape(INSTALL_HINT)):
        run_struct_payloads()


@needs_payload_deps
def test_the_vllm_pipeline_script_prints_ratios_against_the_baseline() -> None:
    result = _run(
        sys.executable,
        "benchmarks/vllm_pipeline.py",
        "--backends",
        "main-shm,push-ipc",
        "--repeats",
        "1",
        "--paced-requests",
        "1",
        "--paced-chunks",
        "3",
        "--pace-ms",
        "5",
        "--requests",
        "2",
        "--chunks",
        "3",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "every chunk checked" in result.stdout and "ZmqConnector push ipc, shm auto" in result.stdout
    assert "ratios against main's SharedMemoryConnector (restated)" in result.stdout


@needs_payload_deps
def test_a_stage_that_fails_reports_why_to_the_parent_and_every_stage_still_exits(short_tmp: Path) -> None:
    from zmq_omni.bench import vllm_pipeline
    from zmq_omni.bench._vllm_stage import PayloadShapes

    ctx = multiprocessing.get_context("forkserver")
    spec = {"name": "push-ipc", "connector": "ZmqConnector", "extra": {"mode": "sideways"}}
    pipeline = vllm_pipeline._Pipeline(ctx, spec, PayloadShapes(), short_tmp)
    try:
        with pytest.raises(RuntimeError, match=r"crashed:(.|\n)*mode"):
            pipeline.wait_up(60)
    finally:
        for stage in (0, 1, 2):
            pipeline.stop(stage)
            pipeline.join(stage)
    assert "ConfigError" in pipeline.output()
    assert _bench_children() == []

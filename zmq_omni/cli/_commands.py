"""The ``stage``, ``drive``, ``health`` and ``shm-sweep`` subcommands."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from ..connectors.inproc import InProcConnector
from ..errors import AuthenticationError, ConfigError, TransportError
from ..stages import PipelineConfig, PipelineDriver, StageWorker, load_pipeline_config
from ._run import Progress, drive_requests, format_table, make_out_dir

__all__ = ["run_drive", "run_health", "run_keygen", "run_shm_sweep", "run_stage", "wait_ready"]

#: Set by ``zmq-omni demo`` for its stage processes: they exit when that process dies.
PARENT_PID_ENV = "ZMQ_OMNI_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Make this process get SIGTERM when the demo that started it dies, even by SIGKILL."""
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if str(os.getppid()) != parent:  # the parent died before prctl took effect
        raise SystemExit(0)


def run_stage(args: argparse.Namespace) -> int:
    """Run one stage until SIGTERM/SIGINT; then shut the adapters down, close the connectors, exit 0."""
    _die_with_parent()
    pipeline = load_pipeline_config(args.config)
    spec = pipeline.stage(args.stage)
    worker = StageWorker.from_pipeline(pipeline, args.stage)
    in_process = [type(conn).__name__ for conn in worker.connectors if isinstance(conn, InProcConnector)]
    if in_process:
        # Its peers would be other processes, which an in-process connector never reaches: drive would wait forever.
        worker.close()
        raise ConfigError(
            f"stage {spec.name!r} uses {in_process[0]}, an in-process connector, which cannot reach "
            "stages in other processes; run all its stages in one process (StageWorker.start()) "
            "or give its edges ZmqConnector or SharedMemoryConnector"
        )

    def stop(signum: int, frame: FrameType | None) -> None:
        worker.stop()

    exporter = None
    if args.metrics_port is not None:
        from ..metrics import PrometheusExporter

        try:
            exporter = PrometheusExporter(
                worker.health, port=args.metrics_port, addr=args.metrics_addr, prefix="zmq_omni_stage"
            )
        except (ImportError, OSError) as exc:
            worker.close()
            raise ConfigError(f"--metrics-port {args.metrics_port}: {exc}") from exc
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        metrics = f"; metrics on http://{exporter.addr}:{exporter.port}/metrics" if exporter else ""
        print(
            f"zmq-omni stage {spec.name} (stage id {spec.stage_id}) serving on {spec.endpoint or '-'}{metrics}",
            file=sys.stderr,
            flush=True,
        )
        worker.run()
        health = worker.health()
    finally:
        if exporter is not None:
            exporter.close()
        worker.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    # The counts once close() settled them: a request counts as completed only when its final chunk was put.
    health.update(worker.stats)
    if args.stats_out:
        Path(args.stats_out).write_text(json.dumps(health, default=str), encoding="utf-8")
    print(
        f"zmq-omni stage {spec.name}: stopped ({health['completed']} requests completed, {health['failed']} failed)",
        file=sys.stderr,
        flush=True,
    )
    return 0


def wait_ready(pipeline: PipelineConfig, timeout_s: float, *, alive: Any = None) -> None:
    """Probe every stage's endpoint until it answers, or raise after ``timeout_s``.

    With a ``keys_dir`` the probes authenticate with the driver's keys.

    Raises:
        TransportError: a stage did not answer in time (named in the message).
        AuthenticationError: a stage refused the driver's keys, or requires keys the pipeline lacks.
    """
    from ..transport import probe

    deadline = time.monotonic() + timeout_s
    for spec in pipeline.stages:
        if not spec.endpoint:
            continue
        while True:
            if alive is not None:
                reason = alive()
                if reason:
                    raise TransportError(reason)
            try:
                probe(
                    spec.endpoint,
                    timeout_s=min(1.0, max(0.05, deadline - time.monotonic())),
                    **pipeline.probe_keys(pipeline.driver.name, spec),
                )
                break
            except AuthenticationError as exc:  # waiting longer cannot help
                raise AuthenticationError(f"stage {spec.name!r}: {exc}") from exc
            except TransportError as exc:
                if time.monotonic() >= deadline:
                    raise TransportError(f"stage {spec.name!r} is not answering: {exc}") from exc
                time.sleep(0.05)


def run_drive(args: argparse.Namespace) -> int:
    """Submit requests, print one line per request and the report; 1 when any request failed."""
    pipeline = load_pipeline_config(args.config)
    if args.timeout is not None:
        pipeline = _with_timeout(pipeline, args.timeout)
    out_dir = make_out_dir(Path(args.out)) if args.out else None
    if args.wait_ready > 0:
        wait_ready(pipeline, args.wait_ready)
    with PipelineDriver.from_pipeline(pipeline) as driver:
        run = drive_requests(
            driver,
            pipeline,
            requests=args.requests,
            chunks=args.chunks,
            payload_size=args.payload_size,
            out_dir=out_dir,
            progress=Progress(),
            prefix=args.prefix,
        )
    for result in run.requests.values():
        if result.failed is None and result.done:
            ttfa = (result.first_output_at or result.submitted_at) - result.submitted_at
            print(
                f"{result.request_id} completed: {result.chunks} chunks, {result.bytes} bytes, "
                f"first output after {ttfa * 1e3:.1f} ms",
                flush=True,
            )
        else:
            print(f"{result.request_id} FAILED: {result.failed or 'did not finish'}", flush=True)
    names = " -> ".join(spec.name for spec in pipeline.stages)
    print(
        format_table(
            run,
            title=f"zmq-omni drive: {pipeline.name} ({names})",
            chunks_per_request=args.chunks,
            payload_size=args.payload_size,
        ),
        flush=True,
    )
    if out_dir is not None:
        wavs = [r.wav_path for r in run.requests.values() if r.wav_path is not None]
        where = f" ({wavs[0].name} ... {wavs[-1].name})" if wavs else ""
        print(f"\n  {len(wavs)} WAV files in {out_dir.resolve()}/{where}", flush=True)
    return 1 if run.failed else 0


def _with_timeout(pipeline: PipelineConfig, timeout_s: float) -> PipelineConfig:
    from dataclasses import replace

    if timeout_s <= 0:
        raise ConfigError(f"--timeout must be > 0, got {timeout_s}")
    return replace(pipeline, request_timeout_s=timeout_s)


def run_health(args: argparse.Namespace) -> int:
    """Probe one endpoint: print its health as JSON and exit 0, or one line on stderr and exit 1.

    CURVE: ``--keys FILE`` (a key file from ``zmq-omni keygen --config``), else with
    ``--config`` the pipeline's ``keys_dir``: ``health.keys`` when it is there, else
    the probed stage's own file (a healthcheck beside the stage). The server key is
    ``--server-key``, else the key file's entry for ``--stage``.
    """
    from ..stages.keys import HEALTH_PROBER, KeyFile
    from ..transport import probe

    if args.timeout <= 0:
        raise ConfigError(f"--timeout must be > 0, got {args.timeout}")
    endpoint, target = args.endpoint, None
    keys: KeyFile | None = None
    if args.config:
        pipeline = load_pipeline_config(args.config)
        if args.stage:
            target = pipeline.stage(args.stage)
            endpoint = target.endpoint
            if not endpoint:
                raise ConfigError(f"stage {args.stage!r} has no endpoint")
        if not args.keys and pipeline.keys_dir is not None:
            own = target.name if target is not None else HEALTH_PROBER
            prober = HEALTH_PROBER if KeyFile.path_in(pipeline.keys_dir, HEALTH_PROBER).is_file() else own
            keys = pipeline.key_file(prober)
    elif args.stage:
        raise ConfigError("--stage needs --config")
    if args.keys:
        keys = KeyFile.load(args.keys)
    curve: dict[str, str] = {}
    if keys is not None:
        server_key = args.server_key
        if server_key is None and target is not None:
            server_key = keys.public_key if keys.name == target.name else keys.servers.get(target.stage_id)
        if server_key is None:
            raise ConfigError("with CURVE keys, name the stage (--config with --stage) or give --server-key")
        curve = {"server_key": server_key, "public_key": keys.public_key, "secret_key": keys.secret_key}
    elif args.server_key:
        curve = {"server_key": args.server_key}  # a throwaway client pair: enough without an allow-list
    try:
        health = probe(endpoint, timeout_s=args.timeout, **curve)
    except TransportError as exc:
        print(f"zmq-omni health: unhealthy: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(health, default=str, sort_keys=True))
    status = health.get("status", "ok") if isinstance(health, dict) else "ok"
    if status != "ok":
        print(f"zmq-omni health: {endpoint} reports status {status!r}", file=sys.stderr)
        return 1
    return 0


def run_shm_sweep(args: argparse.Namespace) -> int:
    """Remove (or list, with --dry-run) shared-memory leftovers of dead processes."""
    from ..shm import sweep

    report = sweep(dry_run=args.dry_run, expire_after=args.expire_after)
    verb = "would remove" if report.dry_run else "removed"
    for path in report.removed:
        print(f"{verb} {path}")
    for path in report.expired:
        print(f"{verb} (expired) {path}")
    print(
        f"shm-sweep: {verb} {len(report.removed) + len(report.expired)} objects, "
        f"{report.freed_bytes} bytes; kept {report.kept_live} of live owners, "
        f"{report.kept_foreign} foreign"
    )
    for line in report.errors:
        print(f"shm-sweep: error: {line}", file=sys.stderr)
    return 1 if report.errors else 0


def run_keygen(args: argparse.Namespace) -> int:
    """``zmq-omni keygen``: a pipeline's key files (``--config``), or one pair printed or written to files.

    Never replaces an existing secret key unless told to (``--force``, ``--rotate``).
    """
    import zmq

    def new_pair() -> tuple[str, str]:
        public, secret = zmq.curve_keypair()
        return public.decode("ascii"), secret.decode("ascii")

    if args.config:
        return _keygen_pipeline(args, new_pair)
    if args.rotate or args.if_missing:
        raise ConfigError("--rotate and --if-missing need --config")
    public, secret = new_pair()
    if not args.out_dir:
        print(f"curve_public_key: {public}")
        print(f"curve_secret_key: {secret}  # keep this one private")
        return 0
    out = Path(args.out_dir)
    secret_path, public_path = out / f"{args.name}.key", out / f"{args.name}.pub"
    if secret_path.exists() and not args.force:
        return _keygen_error(f"{secret_path} exists: refusing to overwrite a secret key (--force replaces it)")
    try:
        out.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Create the secret file 0600 from the start so it is never readable by others, even briefly.
        with contextlib.suppress(FileNotFoundError):
            secret_path.unlink()  # --force: a fresh file gets the 0600 mode even if the old one had another
        fd = os.open(secret_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secret + "\n")
        public_path.write_text(public + "\n")
    except OSError as exc:
        return _keygen_error(f"cannot write {exc.filename or out}: {exc.strerror}")
    print(f"wrote {secret_path} (secret, 0600) and {public_path}")
    return 0


def _keygen_error(message: str) -> int:
    print(f"zmq-omni keygen: error: {message}", file=sys.stderr)
    return 1


def _keygen_pipeline(args: argparse.Namespace, new_pair: Any) -> int:
    from ..stages.keys import HEALTH_PROBER, KeyFile, KeyFileExistsError, make_key_files, write_key_files

    pipeline = load_pipeline_config(args.config)
    out_dir = args.out_dir or pipeline.keys_dir
    if not out_dir:
        raise ConfigError("give --out-dir, or set pipeline.keys_dir or ZMQ_OMNI_KEYS_DIR")
    names = [*(spec.name for spec in (*pipeline.stages, pipeline.driver)), HEALTH_PROBER]
    present = [name for name in names if KeyFile.path_in(out_dir, name).is_file()]
    existing: dict[str, KeyFile] = {}
    if args.if_missing and len(present) == len(names):
        print(f"zmq-omni keygen: {out_dir} already holds the keys of every party of {pipeline.name!r}: kept")
        return 0
    if args.rotate:
        missing = sorted(set(names) - set(present))
        if missing:
            return _keygen_error(
                f"--rotate needs the pipeline's existing key files in {out_dir}; "
                f"missing: {', '.join(f'{m}.keys' for m in missing)}"
            )
        existing = {name: KeyFile.load(KeyFile.path_in(out_dir, name)) for name in names}
    files = make_key_files(pipeline.trust(), new_pair, existing=existing, rotate=tuple(args.rotate or ()))
    try:
        written = write_key_files(out_dir, files, replace=args.force or bool(args.rotate))
    except KeyFileExistsError as exc:
        return _keygen_error(f"{exc} (--force replaces every key, --rotate NAME one party's)")
    except OSError as exc:
        return _keygen_error(f"cannot write {exc.filename or out_dir}: {exc.strerror}")
    secrets = [path.name for path in written if path.suffix == ".keys"]
    what = f"rotated {', '.join(args.rotate)}; rewrote" if args.rotate else "wrote"
    print(
        f"zmq-omni keygen: {what} {len(secrets)} key files in {out_dir} (0600, dir 0700): {', '.join(secrets)}; "
        f"public keys in *.pub"
    )
    if args.rotate:
        print("zmq-omni keygen: restart every stage (and the driver) to load them; see docs/security.md")
    return 0

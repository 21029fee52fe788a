"""The ``zmq-omni`` command: demo, stage, drive, health, bench, keygen, shm-sweep.

Every subcommand has ``--help``. Errors from bad config or unreachable peers
are printed as one line on stderr (no traceback) with a non-zero exit:
2 for configuration errors, 1 for everything else.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from ..errors import ConfigError, ZmqOmniError

__all__ = ["build_parser", "main"]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_load_options(parser: argparse.ArgumentParser, *, requests: int, chunks: int, payload_size: int) -> None:
    parser.add_argument("--requests", type=_positive_int, default=requests,
                        help=f"concurrent requests to stream (default {requests})")
    parser.add_argument("--chunks", type=_positive_int, default=chunks,
                        help=f"thinker chunks per request (default {chunks})")
    parser.add_argument("--payload-size", type=_positive_int, default=payload_size, metavar="BYTES",
                        help=f"bytes of hidden states per thinker chunk (default {payload_size})")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``zmq-omni`` (every subcommand has ``--help``)."""
    parser = argparse.ArgumentParser(
        prog="zmq-omni",
        description="Move tensors between the stages of multi-stage inference pipelines over ZeroMQ.",
    )
    parser.add_argument("--log-level", default="WARNING", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                        help="logging level of the zmq_omni loggers (default WARNING)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = sub.add_parser("demo", help="run the three-stage streaming demo pipeline on this machine",
                          description="Start thinker, talker and vocoder as three processes connected by "
                                      "ZmqConnector, stream concurrent requests through them, write each "
                                      "request's audio to a WAV file and print a report.")
    _add_load_options(demo, requests=8, chunks=24, payload_size=1 << 20)
    demo.add_argument("--out", default="zmq-omni-demo-out", metavar="DIR",
                      help="directory for the WAV files (default ./zmq-omni-demo-out)")
    demo.add_argument("--transport", choices=("ipc", "tcp"), default="ipc",
                      help="ipc:// with the shared-memory fast path (default), or tcp://127.0.0.1")
    demo.add_argument("--shm", choices=("auto", "on", "off"), default="auto",
                      help="ZmqConnector shared-memory fast path policy (default auto)")
    demo.add_argument("--timeout", type=float, default=120.0, metavar="S",
                      help="fail a request not completed after this many seconds (default 120)")

    stage = sub.add_parser("stage", help="run one stage of a pipeline described in YAML",
                           description="Run one stage worker until SIGTERM/SIGINT, then stop cleanly (exit 0).")
    stage.add_argument("--config", required=True, metavar="PIPELINE.yaml", help="the pipeline config")
    stage.add_argument("--stage", required=True, metavar="NAME", help="the stage to run (pipeline.stages[].name)")
    stage.add_argument("--stats-out", metavar="FILE", help="write the stage's final health as JSON here on exit")
    stage.add_argument("--metrics-port", type=int, metavar="PORT",
                       help="serve the stage's health as Prometheus gauges on this port (needs zmq-omni[metrics])")
    stage.add_argument("--metrics-addr", default="127.0.0.1", metavar="ADDR",
                       help="address for --metrics-port (default 127.0.0.1; 0.0.0.0 in containers is explicit)")

    drive = sub.add_parser("drive", help="submit requests to a pipeline and report each one",
                           description="Submit requests to the first stage of a pipeline, collect the last "
                                       "stage's output, print one line per request and a report. Exits 1 if "
                                       "any request failed; a dead stage fails requests, never hangs.")
    drive.add_argument("--config", required=True, metavar="PIPELINE.yaml", help="the pipeline config")
    _add_load_options(drive, requests=4, chunks=8, payload_size=256 << 10)
    drive.add_argument("--out", metavar="DIR", help="write each request's audio to DIR/<request>.wav")
    drive.add_argument("--wait-ready", type=float, default=30.0, metavar="S",
                       help="wait up to S seconds for every stage to answer a health probe first (default 30; "
                            "0 skips the wait)")
    drive.add_argument("--timeout", type=float, metavar="S",
                       help="fail a request not completed after S seconds (default pipeline.request_timeout_s)")
    drive.add_argument("--prefix", default="req", help="request id prefix (default 'req')")

    health = sub.add_parser("health", help="probe a running stage (exit 0 healthy, 1 not)",
                            description="Send a health probe to a stage's endpoint; print its health as JSON "
                                        "and exit 0, or print one line and exit 1. For container healthchecks.")
    target = health.add_mutually_exclusive_group(required=True)
    target.add_argument("--endpoint", help="tcp://host:port or ipc://path of the stage")
    target.add_argument("--stage", metavar="NAME", help="a stage of --config (its endpoint, after env overrides)")
    health.add_argument("--config", metavar="PIPELINE.yaml", help="the pipeline config (with --stage)")
    health.add_argument("--timeout", type=float, default=2.0, metavar="S", help="probe timeout (default 2)")

    bench = sub.add_parser("bench", help="benchmark grids; prints one table of ratios",
                           description="A compact run of the five benchmark grids of benchmarks/*.py (wire "
                                       "codec, ZmqConnector against raw pyzmq, one message in flight, the "
                                       "shared-memory fast path, the adapters), printed as one table of "
                                       "ratios measured in the same run; well under two minutes. Writes a "
                                       "PNG when matplotlib is installed.")
    bench.add_argument("--quick", action="store_true", help="fewest sizes and repetitions (a smoke run)")
    plot = bench.add_mutually_exclusive_group()
    plot.add_argument("--plot", metavar="FILE.png", default="zmq-omni-bench.png",
                      help="where to write the plot (needs the plot extra; default zmq-omni-bench.png)")
    plot.add_argument("--no-plot", dest="plot", action="store_const", const=None, help="write no plot")

    keygen = sub.add_parser("keygen", help="make a CURVE key pair for encrypted TCP between hosts",
                            description="Print a new CURVE key pair (Z85) as YAML-ready lines, or write "
                                        "NAME.key (secret) and NAME.pub (public) into --out-dir.")
    keygen.add_argument("--out-dir", metavar="DIR", help="write NAME.key (mode 0600) and NAME.pub here")
    keygen.add_argument("--name", default="stage", help="file name stem with --out-dir (default 'stage')")

    sweep = sub.add_parser("shm-sweep", help="remove shared-memory leftovers of dead processes",
                           description="List and remove zmq_omni shared-memory segments and records whose "
                                       "owner process is dead. Live owners' segments are never touched.")
    sweep.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    sweep.add_argument("--expire-after", type=float, metavar="S",
                       help="also remove unconsumed records of live owners older than S seconds")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``zmq-omni``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("zmq_omni").setLevel(args.log_level)
    command = args.command
    try:
        if command == "demo":
            from ._demo import run_demo

            return run_demo(args)
        if command == "bench":
            from ._bench import run_bench

            return run_bench(args)
        from . import _commands

        handler = {"stage": _commands.run_stage, "drive": _commands.run_drive, "health": _commands.run_health,
                   "keygen": _commands.run_keygen, "shm-sweep": _commands.run_shm_sweep}[command]
        return handler(args)
    except ConfigError as exc:
        print(f"zmq-omni {command}: configuration error: {exc}", file=sys.stderr)
        return 2
    except ZmqOmniError as exc:
        print(f"zmq-omni {command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"zmq-omni {command}: interrupted", file=sys.stderr)
        return 130

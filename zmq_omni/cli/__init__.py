"""The ``zmq-omni`` command: demo, stage, drive, health, bench, keygen, shm-sweep.

Every subcommand has ``--help``. Errors from bad arguments, bad config,
unwritable paths or unreachable peers are printed as one line on stderr (no
traceback) with a non-zero exit: 2 for usage and configuration errors, 1 for
everything else.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

from .. import __version__
from ..errors import ConfigError, ZmqOmniError

__all__ = ["build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line on stderr, like every other error of the command."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _tcp_port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port, 0 to 65535, got {value}")
    return value


def _add_load_options(parser: argparse.ArgumentParser, *, requests: int, chunks: int, payload_size: int) -> None:
    parser.add_argument(
        "--requests", type=_positive_int, default=requests, help=f"concurrent requests to stream (default {requests})"
    )
    parser.add_argument(
        "--chunks", type=_positive_int, default=chunks, help=f"thinker chunks per request (default {chunks})"
    )
    parser.add_argument(
        "--payload-size",
        type=_positive_int,
        default=payload_size,
        metavar="BYTES",
        help=f"bytes of hidden states per thinker chunk (default {payload_size})",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``zmq-omni`` (every subcommand has ``--help``)."""
    parser = _Parser(
        prog="zmq-omni",
        description="Move tensors between the stages of multi-stage inference pipelines over ZeroMQ.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--log-level",
        default="WARNING",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="logging level of the zmq_omni loggers (default WARNING)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = sub.add_parser(
        "demo",
        help="run the three-stage streaming demo pipeline on this machine",
        description="Start thinker, talker and vocoder as three processes connected by "
        "ZmqConnector, stream concurrent requests through them, write each "
        "request's audio to a WAV file and print a report.",
    )
    _add_load_options(demo, requests=8, chunks=24, payload_size=1 << 20)
    demo.add_argument(
        "--out",
        default="zmq-omni-demo-out",
        metavar="DIR",
        help="directory for the WAV files (default ./zmq-omni-demo-out)",
    )
    demo.add_argument(
        "--transport",
        choices=("ipc", "tcp"),
        default="ipc",
        help="ipc:// with the shared-memory fast path (default), or tcp://127.0.0.1",
    )
    demo.add_argument(
        "--shm",
        choices=("auto", "on", "off"),
        default="auto",
        help="ZmqConnector shared-memory fast path policy (default auto)",
    )
    demo.add_argument(
        "--timeout",
        type=_positive_float,
        default=120.0,
        metavar="S",
        help="fail a request not completed after this many seconds (default 120)",
    )

    stage = sub.add_parser(
        "stage",
        help="run one stage of a pipeline described in YAML",
        description="Run one stage worker until SIGTERM/SIGINT, then stop cleanly (exit 0).",
    )
    stage.add_argument("--config", required=True, metavar="PIPELINE.yaml", help="the pipeline config")
    stage.add_argument("--stage", required=True, metavar="NAME", help="the stage to run (pipeline.stages[].name)")
    stage.add_argument("--stats-out", metavar="FILE", help="write the stage's final health as JSON here on exit")
    stage.add_argument(
        "--metrics-port",
        type=_tcp_port,
        metavar="PORT",
        help="serve the stage's health as Prometheus gauges on this port (needs zmq-omni[metrics]; "
        "0 picks a free port, printed at start-up)",
    )
    stage.add_argument(
        "--metrics-addr",
        default="127.0.0.1",
        metavar="ADDR",
        help="address for --metrics-port (default 127.0.0.1; 0.0.0.0 in containers is explicit)",
    )

    drive = sub.add_parser(
        "drive",
        help="submit requests to a pipeline and report each one",
        description="Submit requests to the first stage of a pipeline, collect the last "
        "stage's output, print one line per request and a report. Exits 1 if "
        "any request failed; a dead stage fails requests, never hangs.",
    )
    drive.add_argument("--config", required=True, metavar="PIPELINE.yaml", help="the pipeline config")
    _add_load_options(drive, requests=4, chunks=8, payload_size=256 << 10)
    drive.add_argument("--out", metavar="DIR", help="write each request's audio to DIR/<request>.wav")
    drive.add_argument(
        "--wait-ready",
        type=float,
        default=30.0,
        metavar="S",
        help="wait up to S seconds for every stage to answer a health probe first (default 30; 0 skips the wait)",
    )
    drive.add_argument(
        "--timeout",
        type=_positive_float,
        metavar="S",
        help="fail a request not completed after S seconds (default pipeline.request_timeout_s)",
    )
    drive.add_argument("--prefix", default="req", help="request id prefix (default 'req')")

    health = sub.add_parser(
        "health",
        help="probe a running stage (exit 0 healthy, 1 not)",
        description="Send a health probe to a stage's endpoint; print its health as JSON "
        "and exit 0, or print one line and exit 1. For container healthchecks. "
        "A CURVE stage needs the prober's keys: --keys, or --config whose "
        "keys_dir holds health.keys.",
    )
    target = health.add_mutually_exclusive_group(required=True)
    target.add_argument("--endpoint", help="tcp://host:port or ipc://path of the stage")
    target.add_argument("--stage", metavar="NAME", help="a stage of --config (its endpoint, after env overrides)")
    health.add_argument("--config", metavar="PIPELINE.yaml", help="the pipeline config (with --stage)")
    health.add_argument(
        "--keys",
        metavar="FILE",
        help="CURVE key file of the prober (default with --config: KEYS_DIR/health.keys, "
        "else the stage's own KEYS_DIR/NAME.keys)",
    )
    health.add_argument(
        "--server-key", metavar="KEY", help="the stage's CURVE public key (default with --stage: from the key file)"
    )
    health.add_argument("--timeout", type=_positive_float, default=2.0, metavar="S", help="probe timeout (default 2)")

    bench = sub.add_parser(
        "bench",
        help="benchmark grids; prints one table of ratios",
        description="A compact run of the six benchmark grids of benchmarks/*.py (wire "
        "codec, ZmqConnector against raw pyzmq, one message in flight, the "
        "shared-memory fast path, the adapters, vllm-omni's three-stage "
        "pipeline against its SharedMemoryConnector), printed as one table of "
        "ratios measured in the same run; 60-90 s on two cores. Writes a "
        "PNG when matplotlib is installed.",
    )
    bench.add_argument("--quick", action="store_true", help="fewest sizes and repetitions (a smoke run)")
    plot = bench.add_mutually_exclusive_group()
    plot.add_argument(
        "--plot",
        metavar="FILE.png",
        default="zmq-omni-bench.png",
        help="where to write the plot (needs the plot extra; default zmq-omni-bench.png)",
    )
    plot.add_argument("--no-plot", dest="plot", action="store_const", const=None, help="write no plot")

    keygen = sub.add_parser(
        "keygen",
        help="make CURVE keys: a whole pipeline's, or one pair",
        description="With --config: the key files of every stage, the driver and the "
        "health prober of a pipeline, in --out-dir (default: its keys_dir): "
        "NAME.keys (0600: the party's pair and the public keys it needs) and "
        "NAME.pub, in a 0700 directory. Without: print one CURVE key pair (Z85), "
        "or write NAME.key (secret) and NAME.pub into --out-dir. An existing "
        "secret key is never replaced without --force (or --rotate).",
    )
    keygen.add_argument("--config", metavar="PIPELINE.yaml", help="make the key files of this pipeline")
    keygen.add_argument("--out-dir", metavar="DIR", help="where to write the key files")
    keygen.add_argument("--name", default="stage", help="file name stem of one pair with --out-dir (default 'stage')")
    replace = keygen.add_mutually_exclusive_group()
    replace.add_argument("--force", action="store_true", help="replace existing key files (every key changes)")
    replace.add_argument(
        "--rotate",
        action="append",
        metavar="NAME",
        help="with --config: give party NAME a new pair and rewrite the files that name it "
        "(repeatable; other pairs are kept)",
    )
    replace.add_argument(
        "--if-missing", action="store_true", help="with --config: do nothing when every key file exists (setup steps)"
    )

    sweep = sub.add_parser(
        "shm-sweep",
        help="remove shared-memory leftovers of dead processes",
        description="List and remove zmq_omni shared-memory segments and records whose "
        "owner process is dead. Live owners' segments are never touched.",
    )
    sweep.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    sweep.add_argument(
        "--expire-after",
        type=float,
        metavar="S",
        help="also remove unconsumed records of live owners older than S seconds",
    )
    return parser


_Z85_KEY_CHARS = 40  # a CURVE key of 32 bytes, Z85-encoded


def _keys_as_values(argv: list[str]) -> list[str]:
    """Join ``--server-key KEY`` (or an abbreviation of the option) into ``--server-key=KEY``.

    A Z85 key (40 characters) may begin with ``-``, which argparse would read as an
    option and refuse with "expected one argument". Anything else is left to argparse.
    """
    joined: list[str] = []
    position = 0
    while position < len(argv):
        arg = argv[position]
        value = argv[position + 1] if position + 1 < len(argv) else ""
        if arg.startswith("--server") and "--server-key".startswith(arg) and len(value) == _Z85_KEY_CHARS:
            joined.append(f"--server-key={value}")
            position += 2
        else:
            joined.append(arg)
            position += 1
    return joined


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``zmq-omni``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(_keys_as_values(sys.argv[1:] if argv is None else list(argv)))
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

        handler = {
            "stage": _commands.run_stage,
            "drive": _commands.run_drive,
            "health": _commands.run_health,
            "keygen": _commands.run_keygen,
            "shm-sweep": _commands.run_shm_sweep,
        }[command]
        return handler(args)
    except ConfigError as exc:
        print(f"zmq-omni {command}: configuration error: {exc}", file=sys.stderr)
        return 2
    except ZmqOmniError as exc:
        print(f"zmq-omni {command}: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a path we could not write, a port we could not bind: the OS says why
        print(f"zmq-omni {command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"zmq-omni {command}: interrupted", file=sys.stderr)
        return 130

"""The process's ZeroMQ context, socket options, and the malloc tuning for large receives.

libzmq allocates every received message with ``malloc``. glibc serves a
64-256 MiB request with a fresh ``mmap``, so the receiver page-faults on every
page of every large message and streams at ~1.4 GB/s although memcpy runs at
10+ GB/s. :func:`tune_malloc` keeps large blocks on the heap (no mmap, no trim,
one arena) so freed message memory is reused without faults. It must run
before libzmq's I/O threads first allocate, so the first connector of a
process creates the context after the tuning.

The connectors of one process share one context (:func:`use_context`), as
ZeroMQ intends: one I/O thread then carries a stage's inbound and outbound
messages. With a context per connector, a message in and the answer out wake
two I/O threads, each asleep since the last message, and a lone round trip
between two stages takes 6-15 % longer. The last
connector to let go terminates it, which also flushes the last
acknowledgements within their linger; a connector that installs a ZAP
authenticator (a CURVE allow-list) gets a context of its own, since an
authenticator answers for every socket of its context.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import ipaddress
import logging
import os
import socket
import stat
import threading
import time
from typing import Any

import zmq

from ..errors import TransportError, from_zmq_error

__all__ = [
    "bind",
    "close_bound",
    "close_socket",
    "listening",
    "make_socket",
    "malloc_tuned",
    "new_context",
    "refuse_live_ipc",
    "release_context",
    "tune_malloc",
    "use_context",
]

log = logging.getLogger("zmq_omni.transport")

# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

_lock = threading.Lock()
_tuned: bool | None = None
_contexts_made = 0
# The process's shared context, how many users hold it, and the process that made it (a forked
# child must never use its parent's context: it makes its own).
_shared: zmq.Context[Any] | None = None
_shared_users = 0
_shared_pid = 0


def reserve_loopback_port() -> int:
    """A free 127.0.0.1 port that stays reserved for the ZeroMQ endpoint that binds it next.

    A port merely bound and released can be handed to anyone before the stage
    binds it. This one is left in TIME_WAIT by a closed connection: for the next
    minute the kernel hands it to no ``bind(port 0)`` and no outgoing connection,
    while a listener with SO_REUSEADDR (as ZeroMQ's is) can still bind it.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port: int = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):
            accepted, _ = listener.accept()
            accepted.close()  # the side that closes first holds the TIME_WAIT: ours, on `port`
        return port


def tune_malloc() -> bool:
    """Make glibc reuse heap memory for large blocks (once per process); True when applied.

    Trade-off: freed memory stays in the process (its peak RSS is kept) instead
    of going back to the OS; opt out with ``malloc_tuning: false``. One arena,
    because libzmq's I/O thread allocates the messages: in an arena of its own
    glibc would ``mmap`` each message of 64 MiB or more afresh (docs/limits.md
    has what one arena costs an event loop under load).
    """
    global _tuned
    with _lock:
        if _tuned is None:
            _tuned = False
            name = ctypes.util.find_library("c")
            try:
                libc = ctypes.CDLL(name)
                # mallopt parameters are glibc's; musl has no gnu_get_libc_version and other meanings.
                if name and hasattr(libc, "gnu_get_libc_version"):
                    _tuned = bool(
                        libc.mallopt(_M_ARENA_MAX, 1)
                        and libc.mallopt(_M_MMAP_MAX, 0)
                        and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
                    )
            except OSError:  # no C library to load: nothing to tune
                _tuned = False
            if _tuned and _contexts_made:
                log.info("malloc tuned after a ZeroMQ context started; its earlier allocations keep their pages")
        return _tuned


def malloc_tuned() -> bool:
    """True once :func:`tune_malloc` applied glibc's tuning: one heap, no ``mmap``'d blocks, no trim on ``free``."""
    return bool(_tuned)


def new_context() -> zmq.Context[Any]:
    """A fresh context with one I/O thread (its owner terminates it)."""
    with _lock:
        return _make_context()


def _make_context() -> zmq.Context[Any]:
    global _contexts_made
    _contexts_made += 1  # caller holds _lock
    return zmq.Context(io_threads=1)


def use_context(*, private: bool = False) -> zmq.Context[Any]:
    """The process's shared context (a new one with ``private``); hand it back with :func:`release_context`."""
    global _shared, _shared_users, _shared_pid
    if private:
        return new_context()
    with _lock:
        if _shared is None or _shared_pid != os.getpid():
            _shared, _shared_users, _shared_pid = _make_context(), 0, os.getpid()
        _shared_users += 1
        return _shared


def release_context(ctx: zmq.Context[Any], *, wait: bool = True) -> None:
    """Let go of a context from :func:`use_context` once every socket made on it is closed.

    A private context is terminated at once; the shared one when its last user lets
    go. Termination waits, at most each socket's linger, for what they still send;
    with ``wait=False`` (an event loop's thread) that wait happens in a short-lived thread.
    """
    global _shared, _shared_users
    with _lock:
        if ctx is _shared and _shared_pid == os.getpid():
            _shared_users -= 1
            if _shared_users > 0:
                return
            _shared = None
    # Outside the lock: a last ack may take its linger to leave, and other connectors may start meanwhile.
    if wait:
        ctx.destroy()
    else:
        threading.Thread(target=ctx.destroy, name="zmq-omni-term", daemon=True).start()


def make_socket(
    ctx: zmq.Context[Any],
    kind: int,
    *,
    hwm: int,
    max_message_bytes: int | None = None,
    identity: bytes | None = None,
) -> Any:
    """A socket with zmq_omni's defaults: finite HWM, linger 0 unless closed with one, bounded size."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    if max_message_bytes is not None:
        # libzmq drops the connection of a peer that sends a bigger frame: a cheap DoS guard.
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    if identity is not None:
        sock.setsockopt(zmq.ROUTING_ID, identity)
    if kind == zmq.ROUTER:
        # Unroutable replies raise instead of vanishing; a reconnecting identity takes over its route.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    if kind in (zmq.DEALER, zmq.PUSH):
        sock.setsockopt(zmq.RECONNECT_IVL, 50)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    return sock


def bind(sock: Any, endpoint: str) -> str:
    """Bind ``sock``; return the endpoint actually bound (port 0/``*`` resolved).

    Raises:
        TransportError: naming the endpoint (address in use, no such interface, ...).
    """
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        endpoint = endpoint[:-1] + "*"
    if endpoint.startswith("ipc://"):
        refuse_live_ipc(endpoint)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise from_zmq_error(exc, endpoint=endpoint, op="bind") from exc
    last = sock.getsockopt(zmq.LAST_ENDPOINT)
    return last.decode() if isinstance(last, bytes) else str(last)


def refuse_live_ipc(endpoint: str) -> None:
    """Raise when a live process already listens on the socket file of ``ipc://`` ``endpoint``.

    libzmq's ipc bind unlinks an existing socket file and binds a new one, so a
    second bind on the path of a live listener would silently take its traffic
    (peers that connect later reach the newcomer). A connect probe tells a live
    listener (accepts) from a stale file (refused), which libzmq may replace.
    Abstract endpoints (``ipc://@name``) fail with "address in use" by themselves.

    Raises:
        TransportError: naming the endpoint, when a listener answers there.
    """
    if _listened(endpoint, timeout_s=1.0):
        raise TransportError(
            f"bind failed: another process is listening on {endpoint} (give each receiving stage, replica and rank "
            "its own endpoint)",
            endpoint=endpoint,
        )


def close_socket(sock: Any, linger_ms: int = 0) -> None:
    """Close with an explicit linger (never the blocking default); ignore an already-closed socket."""
    if sock is None or sock.closed:
        return
    with contextlib.suppress(zmq.ZMQError):  # closed twice or after context teardown: nothing to release
        sock.close(linger=linger_ms)


def close_bound(sock: Any, endpoint: str | None, *, linger_ms: int = 0, wait_s: float = 1.0) -> None:
    """Close a bound socket, then wait (at most ``wait_s``) until nothing listens on ``endpoint`` any more.

    ``zmq_close`` only hands the socket to libzmq, whose I/O thread closes the
    listener a moment later. On the shared context nothing else waits for that
    (terminating a context of one's own would), so a stage that
    closes its receiver and opens a new one on the same endpoint would find its
    old listener still there. Something still listening after ``wait_s`` (> 0) is logged as a
    WARNING naming the endpoint.
    """
    close_socket(sock, linger_ms=linger_ms)
    if endpoint is None or wait_s <= 0:
        return
    deadline = time.monotonic() + wait_s
    while _listened(endpoint, timeout_s=0.1):
        if time.monotonic() >= deadline:
            log.warning("closed, but something still listens on %s after %.1f s: a bind there fails", endpoint, wait_s)
            return
        time.sleep(0.001)


def listening(endpoint: str) -> bool:
    """True while something accepts connections on ``endpoint`` (an ipc path or a TCP port); False when unsure."""
    return _listened(endpoint, timeout_s=0.1)


def _listened(endpoint: str, *, timeout_s: float) -> bool:
    """True while something accepts connections on ``endpoint`` (ipc path or TCP port); False when unsure.

    A connect probe tells a live listener (accepts) from a stale socket file or a
    closed port (refused). Abstract ipc endpoints (``ipc://@name``) are not probed.
    """
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://") :]
        if not path or path.startswith("@") or path == "*":
            return False
        try:
            if not stat.S_ISSOCK(os.stat(path).st_mode):
                return False
        except OSError:  # absent (libzmq unlinks the file as its listener closes) or unreadable
            return False
        family: int = socket.AF_UNIX
        address: Any = path
    elif endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://") :].rpartition(":")
        host = host.strip("[]")
        if not port.isdigit():
            return False
        if host in ("*", "0.0.0.0", "", "localhost"):
            host = "127.0.0.1"
        elif host == "::":
            host = "::1"
        try:  # an address of this host: a name is never looked up (nor anything off the host probed)
            family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
        except ValueError:
            return False
        address = (host, int(port))
    else:
        return False
    probe = socket.socket(family, socket.SOCK_STREAM)
    probe.settimeout(timeout_s)
    try:
        probe.connect(address)
    except OSError:
        return False  # refused or unreachable: nothing listens there (a stale file of a process that exited)
    finally:
        probe.close()
    return True

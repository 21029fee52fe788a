"""One bound receive side per process and address, shared by every ``ZmqConnector`` bound there.

vllm-omni builds two connectors from one spec in one stage process (the
scheduler's chunk adapter and the model runner's mixin); both must receive on
the stage's one endpoint. So the bound part of a ``ZmqConnector`` (the push
mode receiver, or the pull mode server) is not the connector's own: it is a
:class:`SharedEndpoint`, kept in a process-wide registry under its resolved
bind address, with its own I/O thread that owns its socket. Each connector
bound at that address holds it (a reference count); the last one to close
closes it.

* **One mailbox.** Connectors on one endpoint take from one mailbox: each key
  is delivered once, to whichever connector asks first.
* **One set of settings.** Connectors sharing an address must agree on the
  settings the bound part uses (the caller says which); a connector that
  differs is refused with a :class:`~zmq_omni.errors.ConfigError` naming them.
* **Own payloads (pull mode).** Each payload in the shared store belongs to the
  connector that stored it: its ``flush`` waits for its own payloads only, and
  a connector that leaves while others still hold the endpoint takes its
  unfetched payloads out of the store and reports them failed (as the last
  one's close does).
* **Addresses that cannot be shared**: a TCP bind on port 0 or ``*`` takes a
  new port each time, so each such bind is an endpoint of its own.
* **A forked child** starts with an empty registry and without the parent's
  bound sockets (closed in the child at the fork): a connector it builds binds,
  or becomes a local client of the stage's binder, as in any other process.
* **Driven by threads or by one event loop, never both.** A connector driven
  by an event loop (``zmq_omni.aio``'s ``LoopDriver``) binds an *exclusive*
  endpoint: its part runs on that connector's driver, whose loop alone uses the
  socket. Another connector of the process binding the same address, threaded
  or not, is refused with a :class:`~zmq_omni.errors.ConfigError` that says
  why (and the reverse): one socket cannot be driven by both threads and a loop.

The registry also answers "does this process serve that endpoint?" for
put-then-get in one process (push mode): a put to an endpoint this process
binds is *expected* there until it arrives (the endpoint's
:class:`~zmq_omni.connectors._expected_puts.ExpectedPuts`, adopted as it
registers), and a ``get`` of its key that finds nothing waits for it, bounded
by the put's window (``metadata_get_timeout_s``) instead of returning ``None``
while the put is on its way through ZeroMQ.

Threads and locks: the registry's dicts change under ``_registry_lock``
(readers on hot paths look them up without it: a dict lookup is atomic).
Binding and closing happen outside that lock (a bind can take a while: the
ZAP thread, the ipc liveness probe), with a per-address marker in ``_busy``
meanwhile: a connector acquiring that address waits for the marker (bounded)
and looks again, so it never binds while the old socket is still open, and
binds at other addresses are not held up. A close whose I/O thread stops late
(busy in a handler) leaves the marker until that thread closed the socket.
A :class:`SharedEndpoint`'s holders and hooks change under its ``_lock``; its
expected puts under :mod:`~zmq_omni.connectors._expected_puts`'s lock; its part is driven by its own I/O thread (see
:mod:`zmq_omni.transport._receiver`, :mod:`zmq_omni.transport._pull_server`),
or, for an exclusive endpoint, by its one connector's driver.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..errors import ConfigError, TransportError, ZmqOmniError
from ..metrics import Counters
from ..transport import Driver, PullServer, PushReceiver, ShmReceive, ShmSend, close_inherited_sockets, listening
from . import _expected_puts
from ._expected_puts import ExpectedPuts

__all__ = ["Holder", "SharedEndpoint", "acquire", "address_released", "has_served", "served"]

log = logging.getLogger("zmq_omni.connectors")

#: Longest a close waits for the endpoint's I/O thread to close the socket: it ends the handler it runs
#: first (one message's decode at most: a first CUDA decode can take seconds).
_CLOSE_WAIT_S = 10.0
#: Longest an acquire waits for the same address's bind or close in progress (a close waits up to _CLOSE_WAIT_S).
_BUSY_WAIT_S = _CLOSE_WAIT_S + 2.0
#: Longest a close waits for libzmq's I/O thread to close a closed socket's listener.
_FREE_WAIT_S = 1.0

Slot = tuple[str, str, str]


class Holder(Protocol):
    """What a :class:`SharedEndpoint` calls back on the connectors holding it."""

    def health(self) -> dict[str, Any]:
        """The connector's health (a health probe's answer)."""
        ...

    def on_failure(self, op: str, from_stage: str, to_stage: str, key: str, reason: str, error: ZmqOmniError) -> None:
        """Keep a failure found by the shared part for a put of this connector."""
        ...


class SharedEndpoint:
    """A bound push receiver or pull server with its own I/O thread, held by one or more connectors.

    Build it with :func:`acquire`; give it back with :meth:`release`.

    Attributes:
        address: the bind address it is registered under.
        loop: what drives the part (it owns the part's socket): its own I/O thread, or the
            driver of its one connector (``exclusive``).
        exclusive: bound by a connector driven by an event loop: nobody else may hold it.
        part: the bound :class:`PushReceiver` or :class:`PullServer` (set once built).
        counters: the counters the part reports into (each holder's ``health()`` adds them).
        settings: what its holders must agree on (see the module docstring).
        expected: this process's puts on their way here (push mode).
    """

    def __init__(
        self,
        address: str,
        settings: Any,
        loop: Driver,
        *,
        shm_receive: ShmReceive | None = None,
        shm_send: ShmSend | None = None,
        exclusive: bool = False,
    ) -> None:
        self.address = address
        self.settings = settings
        self.loop = loop
        self.exclusive = exclusive
        self.part: PushReceiver | PullServer | None = None
        self.counters = Counters()
        self.shm_receive = shm_receive
        self.shm_send = shm_send
        self._lock = threading.Lock()
        self._holders: list[Holder] = []  # copy-on-write: callbacks iterate without the lock
        self._arrival_hooks: tuple[Callable[[list[Slot]], None], ...] = ()
        self._room_hooks: tuple[Callable[[], None], ...] = ()
        self._served: tuple[str, ...] = ()  # endpoints under which _by_endpoint knows it
        # Push mode: this process's puts on their way here (the one record of them, adopted as it registers).
        self.expected = ExpectedPuts(self._wake_gets)
        self._closed = False

    # -- holders ---------------------------------------------------------------------------
    @property
    def holders(self) -> int:
        """How many connectors hold it now."""
        return len(self._holders)

    def health(self) -> dict[str, Any]:
        """The first holder's health: what a health probe sent to this endpoint is answered."""
        holders = self._holders
        return holders[0].health() if holders else {"status": "closed"}

    def on_failure(self, op: str, from_stage: str, to_stage: str, key: str, reason: str, error: ZmqOmniError) -> None:
        """The push receiver's failure callback: the first holder keeps it."""
        self.on_owned_failure(None, op, from_stage, to_stage, key, reason, error)

    def on_owned_failure(
        self, owner: Any, op: str, from_stage: str, to_stage: str, key: str, reason: str, error: ZmqOmniError
    ) -> None:
        """The pull server's failure callback: the holder that stored the payload (``owner``) keeps it.

        A payload with no owner (none was announced) goes to the first holder.
        """
        holder: Holder | None = owner
        if holder is None:
            holders = self._holders
            holder = holders[0] if holders else None
        if holder is not None:
            holder.on_failure(op, from_stage, to_stage, key, reason, error)

    def hook_arrivals(self, fn: Callable[[list[Slot]], None]) -> None:
        """Call ``fn`` with the slots of each drain's arrivals (push mode; a holder's watches)."""
        with self._lock:
            if fn not in self._arrival_hooks:
                self._arrival_hooks = (*self._arrival_hooks, fn)
            self._set_hooks()

    def hook_room(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` whenever room may have freed in the pull server's store."""
        with self._lock:
            if fn not in self._room_hooks:
                self._room_hooks = (*self._room_hooks, fn)
            self._set_hooks()

    def _set_hooks(self) -> None:
        """Point the part's single hooks at the fan-outs (under ``_lock``); none while nobody listens."""
        part = self.part
        if isinstance(part, PushReceiver):
            if self._arrival_hooks:
                part.on_arrivals = self._arrived
            else:
                part.on_arrivals = None
        elif isinstance(part, PullServer):
            part.on_window_change(self._room if self._room_hooks else None)

    def _arrived(self, slots: list[Slot]) -> None:
        for fn in self._arrival_hooks:
            fn(slots)

    def _room(self) -> None:
        for fn in self._room_hooks:
            fn()

    def release(self, holder: Holder, hooks: tuple[Callable[..., Any], ...] = ()) -> list[str]:
        """``holder`` closes: drop it and its ``hooks``; the last holder's release closes the part.

        Waits up to ``_CLOSE_WAIT_S`` (10 s) for the I/O thread to end; one that ends later closes
        the socket then, and the address stays marked busy until it has.
        A pull server's payloads that ``holder`` stored and nobody fetched are taken out of the
        store and reported failed to it, whether or not it is the last holder.

        Returns:
            The keys of ``holder``'s puts reported lost (pull: its payloads nobody fetched).
        """
        part = self.part
        lost = part.drop_owned(holder) if isinstance(part, PullServer) else []
        busy: threading.Event | None = None
        with _registry_lock, self._lock:
            self._arrival_hooks = tuple(fn for fn in self._arrival_hooks if fn not in hooks)
            self._room_hooks = tuple(fn for fn in self._room_hooks if fn not in hooks)
            self._set_hooks()
            last = self._holders == [holder] and not self._closed
            if not last:
                self._holders = [h for h in self._holders if h is not holder]
            else:  # it stays the holder while the part closes: the puts it reports failed reach it
                self._closed = True
                if _by_address.get(self.address) is self:
                    del _by_address[self.address]
                    # Until the socket is closed, a connector acquiring this address waits rather than binds.
                    busy = _busy[self.address] = threading.Event()
                for endpoint in self._served:
                    if _by_endpoint.get(endpoint) is self:
                        del _by_endpoint[endpoint]
                _expected_puts.release(self._served, self.expected)
        if not last:
            if isinstance(part, PushReceiver):
                part.wake_gets()  # the holder's waiting gets see its close now (the part stays open)
            return lost
        if busy is not None:
            # The driver closes the socket before its on-term hooks, also when it stops late (busy in a
            # handler past _CLOSE_WAIT_S), and the connector's event loop only as the connector's close
            # stops it: an acquire of this address waits for that, and for the listener to go.
            self.loop.on_term(functools.partial(_end_busy_once_free, self.address, busy, self.loop.threaded))
        closes_late = False
        try:
            lost += self._close()
            closes_late = busy is not None and (self.exclusive or not busy.is_set())
        finally:
            with self._lock:
                self._holders = []
            if busy is not None and not closes_late:
                _end_busy(self.address, busy)
        return lost

    def _close(self) -> list[str]:
        lost = self.part.close() if self.part is not None else None
        shms = [shm for shm in (self.shm_send, self.shm_receive) if shm is not None]
        if self.exclusive:  # the connector's driver closes the socket as it stops: the memory goes after it
            for shm in shms:
                self.loop.on_term(shm.close)
            return lost or []
        if not self.loop.stop(timeout=_CLOSE_WAIT_S):
            log.error(
                "the I/O thread of %s is still busy %ss after close (a handler that does not return): the socket "
                "stays bound until it does, then closes with the context released (a bind there here waits for that)",
                self.address,
                _CLOSE_WAIT_S,
            )
        for shm in shms:
            shm.close()
        return lost or []

    # -- put-then-get in one process (push mode) ---------------------------------------------
    def _wake_gets(self) -> None:
        """Gets waiting for a put this process expected here look again (it was settled)."""
        part = self.part
        if isinstance(part, PushReceiver):
            part.wake_gets()


_registry_lock = threading.Lock()
_by_address: dict[str, SharedEndpoint] = {}  # shareable bind address -> its endpoint
_busy: dict[str, threading.Event] = {}  # shareable bind address -> set once its bind or close in progress ends
_by_endpoint: dict[str, SharedEndpoint] = {}  # every endpoint a SharedEndpoint serves (bound and advertised)


def shareable(address: str) -> bool:
    """False for a TCP bind on port 0 or ``*``: each such bind takes a new port, an endpoint of its own."""
    return not address.startswith("tcp://") or not address.endswith((":0", ":*"))


def acquire(
    address: str,
    settings: Any,
    holder: Holder,
    build: Callable[[], SharedEndpoint],
    advertised: str | None = None,
    *,
    exclusive: bool = False,
) -> SharedEndpoint:
    """The endpoint bound at ``address`` in this process, held by ``holder``: the one there, or a new one.

    A bind or close of the same address in progress (another thread's) is waited for, up to
    ``_BUSY_WAIT_S`` (12 s), then the registry is looked at again.

    Args:
        address: the resolved bind address (registry key).
        settings: what holders must agree on: a mapping of setting name to value, compared
            key by key (any other value is compared with ``==``).
        holder: the connector that will hold it.
        build: makes, binds and starts a new one (called outside the registry lock).
        advertised: the endpoint peers connect to, when it differs from the bound one.
        exclusive: ``holder`` is driven by an event loop: the endpoint is its own, never shared.

    Raises:
        ConfigError: the endpoint there was built with other settings (the differing ones are named),
            or it cannot be shared because ``holder`` or its holder is driven by an event loop.
        TransportError: the bind failed (from ``build``), or the same address's bind or close
            in progress did not end in time.
    """
    share = shareable(address)
    deadline = time.monotonic() + _BUSY_WAIT_S
    while True:
        with _registry_lock:
            busy = _busy.get(address) if share else None
            if busy is None:
                shared = _by_address.get(address) if share else None
                if shared is not None:
                    if shared.exclusive or exclusive:
                        raise _unshareable(address, held_by_loop=shared.exclusive, wanted_by_loop=exclusive)
                    _check_settings(address, shared.settings, settings)
                    return _hold(shared, address, holder, advertised)
                mine = threading.Event() if share else None
                if mine is not None:
                    _busy[address] = mine
                break
        if not busy.wait(max(0.0, deadline - time.monotonic())):
            raise TransportError(
                f"another connector of this process is still binding or closing {address}", endpoint=address
            )
    try:
        shared = build()
    except BaseException:
        if mine is not None:
            _end_busy(address, mine)
        raise
    with _registry_lock:
        if share:
            _by_address[address] = shared
        held = _hold(shared, address, holder, advertised)
    if mine is not None:
        _end_busy(address, mine)
    return held


def _unshareable(address: str, *, held_by_loop: bool, wanted_by_loop: bool) -> ConfigError:
    """Why a connector cannot bind ``address``, which another connector of this process holds."""
    if held_by_loop and wanted_by_loop:
        why = (
            "another ZmqConnector driven by an event loop is bound there, and its socket belongs to that "
            "connector's loop alone; give each its own endpoint"
        )
    else:
        who = (
            "a ZmqConnector driven by an event loop (AsyncConnector.create) is bound there"
            if held_by_loop
            else "a ZmqConnector of this process driven by threads is bound there"
        )
        why = (
            f"{who}, and one socket cannot be driven by both threads and an event loop; give each its own "
            "endpoint, or make the loop's connector threaded: AsyncConnector(ZmqConnector(extra))"
        )
    return ConfigError(f"cannot bind {address}: {why}")


def _check_settings(address: str, have: Any, want: Any) -> None:
    """Raise ConfigError when ``want`` differs from the settings ``have`` the endpoint was built with."""
    if have == want:
        return
    if isinstance(have, dict) and isinstance(want, dict):
        names = sorted(name for name in have.keys() | want.keys() if have.get(name) != want.get(name))
        which = f" ({', '.join(names)})"
    else:
        which = ""
    raise ConfigError(
        f"another connector of this process is bound at {address} with other settings{which}: connectors "
        f"sharing an endpoint must agree on the settings of the bound part"
    )


def _hold(shared: SharedEndpoint, address: str, holder: Holder, advertised: str | None) -> SharedEndpoint:
    """Add ``holder`` to ``shared`` and register the endpoints it serves (under ``_registry_lock``)."""
    with shared._lock:
        shared._holders = [*shared._holders, holder]
    part = shared.part
    served = [address] if part is None else [address, part.endpoint]
    if advertised is not None:
        served.append(advertised)
    new = tuple(endpoint for endpoint in served if endpoint not in shared._served)
    shared._served = (*shared._served, *new)
    # Before it is published as served: a put meanwhile finds the same record under its name.
    shared.expected = _expected_puts.adopt(shared._served, shared.expected, shared)
    for endpoint in new:
        _by_endpoint.setdefault(endpoint, shared)
    return shared


def _end_busy(address: str, busy: threading.Event) -> None:
    """The bind or close marked by ``busy`` ended: remove its marker and wake those waiting on it."""
    with _registry_lock:
        if _busy.get(address) is busy:
            del _busy[address]
    busy.set()


def _end_busy_once_free(address: str, busy: threading.Event, threaded: bool) -> None:
    """End ``busy`` once nothing listens on ``address`` (libzmq closes a listener a moment after its socket).

    Runs on the driver as it stops: the wait, if any, goes to a short-lived thread of its own (always
    for an event loop, which a connect probe must not hold up).
    """
    if threaded and not listening(address):
        _end_busy(address, busy)
        return

    def wait() -> None:
        _wait_free(address)
        _end_busy(address, busy)

    threading.Thread(target=wait, name="zmq-omni-unbind", daemon=True).start()


def _wait_free(endpoint: str) -> bool:
    """Wait (at most ``_FREE_WAIT_S``) until nothing listens on ``endpoint``; False (logged) if something still does.

    libzmq gives no event for its listener's close short of a socket monitor: the wait looks every 1 ms.
    """
    deadline = time.monotonic() + _FREE_WAIT_S
    while listening(endpoint):
        if time.monotonic() >= deadline:
            log.warning("closed, but something still listens on %s after %.1f s: a bind there fails", endpoint, 1.0)
            return False
        time.sleep(0.001)
    return True


def address_released(endpoint: str, *, on_loop: bool, awaited: bool) -> None:
    """A connector driven by an event loop closed its socket bound at ``endpoint``: keep ``close()``'s promise.

    Off the loop's thread, wait until the listener is gone (a WARNING if it outlives ``_FREE_WAIT_S``).
    On the loop's thread a wait would stall the loop: unless the caller awaits the address itself
    (``AsyncConnector.aclose``), a listener still there is logged as a WARNING naming the endpoint
    (a bind there by this process waits for it; another process's fails until it goes).
    """
    if not on_loop:
        _wait_free(endpoint)
    elif not awaited and listening(endpoint):
        log.warning(
            "close() on its event loop's thread returned with %s still bound for a moment (libzmq closes the "
            "listener shortly): a bind there by another process fails meanwhile; use `await aclose()`, which "
            "waits for the address to be free",
            endpoint,
        )


def has_served() -> bool:
    """True when this process binds any endpoint (the cheap test before :func:`served`)."""
    return bool(_by_endpoint)


def served(endpoint: str | None) -> SharedEndpoint | None:
    """The endpoint this process binds at ``endpoint`` (as bound or as advertised), or None."""
    if endpoint is None or not _by_endpoint:
        return None
    return _by_endpoint.get(endpoint)


def _forget_in_child() -> None:
    """A forked child starts with no bound endpoint: the parent's are not its own (they have no I/O thread here).

    The registry is emptied (a connector built in the child binds, or becomes a local client of the
    stage's binder, as any process does) and the child's copies of the bound sockets are closed (kept
    open, they would outlive the parent and keep the stage's next binder from binding).
    """
    global _registry_lock
    addresses = list(_by_address)
    _registry_lock = threading.Lock()  # a thread of the parent may have held it at the fork
    _by_address.clear()
    _busy.clear()
    _by_endpoint.clear()
    _expected_puts.forget_all()
    if addresses:
        close_inherited_sockets(addresses)


os.register_at_fork(after_in_child=_forget_in_child)

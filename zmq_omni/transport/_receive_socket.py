"""Push mode, receiving half: the bound ROUTER and what its driver does with it.

:class:`ReceiveSocket` reads messages into the
:class:`~zmq_omni.transport._receive_protocol.ReceiveProtocol`, stores what
arrived in the :class:`~zmq_omni.transport._mailbox.Mailbox`, sends the
protocol's replies and the acknowledgements due, and closes the socket. It runs
on the driver alone (the endpoint's I/O thread, or the event loop that owns it):
its two entries, :meth:`ReceiveSocket.settle` and :meth:`ReceiveSocket.close`,
assert it (``Driver.owns_sockets_here``); ``read``, ``flush`` and ``send`` are
reached only through them, ``hand_over`` touches no socket, and ``watch`` and
``unwatch`` register its descriptor with the driver.

A message is read across turns (:class:`~zmq_omni.transport._router.RoutedReader`)
within a time budget a turn, shared by every read the turn runs (the descriptor's
handler, a queued serve, a flush timer): the first read of a turn sets the
deadline and a call on the driver's next turn clears it. A message past ``max_frames`` closes the ROUTER,
the only way to make libzmq let go of the rest of it (it queues a multipart
message whole before its first frame can be read), and a new one is bound on the
same endpoint: the protocol's state stays, senders reconnect by themselves and
resend what no REPLY acknowledged (``rebinds`` in health, a logged warning).
The frames read of that message are let go a slice a driver turn, and a second
after the last rebind of a burst the C heap's free pages go back to the OS in
short steps on a thread of their own
(:func:`~zmq_omni.transport._router.trim_malloc_later`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import zmq

from ..errors import ZmqOmniError
from ..metrics import Counters
from ._loop import Driver
from ._mailbox import Mailbox
from ._push_protocol import _MAX_DRAIN
from ._receive_protocol import ReceiveProtocol, Reply
from ._router import RoutedReader, open_router, trim_malloc_later
from ._security import Curve
from ._shm import ShmReceive
from ._sockets import close_bound, close_socket

__all__ = ["ReceiveSocket"]

log = logging.getLogger("zmq_omni.transport")

# Whether the socket holds messages: a zero-timeout ``zmq_poll``, which reads ``ZMQ_EVENTS`` as
# ``sock.get(zmq.EVENTS)`` does (resetting the descriptor alike), without pyzmq's option-enum lookup
# (about 1 us less a look, one a drain).
_zmq_poll = zmq.zmq_poll
# A drain's time, whatever its messages cost: a peer sending messages of a thousand frames (each read
# frame by frame, ~2.5 us a frame) must not hold an event loop's turn for its 512 messages (1.2 s).
_DRAIN_BUDGET_S = 0.01
_SETTLE_ROUNDS = 4  # drains a settle does before it leaves the rest of a flood to the driver's next turn
_REBIND_LINGER_MS = 500  # replies still leaving when the socket is bound anew go on leaving this long
_REBIND_S = 5.0  # how long a rebind tries to bind the endpoint again (libzmq closes the old listener a moment later)
_REBIND_RETRY_S = 0.005
_TRIM_AFTER_S = 1.0  # a dropped message's memory goes back to the OS this long after its socket closed
_LET_GO_FRAMES = 4096  # a given-up message's frames dropped a driver turn (~1 ms)
# How long a closing receiver retries its last acknowledgements to a sender not reconnected to it yet:
# past libzmq's longest reconnect interval (1 s here) plus a CURVE handshake.
_LAST_WORDS_WAIT_S = 2.0
_LAST_WORDS_RETRY_S = 0.005


class ReceiveSocket:
    """A bound ROUTER, its protocol and its mailbox (see the module docstring).

    Raises:
        TransportError: the bind failed (the endpoint is named).
    """

    def __init__(
        self,
        loop: Driver,
        bind_endpoint: str,
        mailbox: Mailbox,
        *,
        incarnation: str,
        decode: Callable[[list[Any]], Any],
        decode_each: Callable[[list[bytes]], list[Any]],
        hwm: int,
        max_message_bytes: int,
        max_frames: int,
        max_key_bytes: int,
        ack_delay_s: float,
        counters: Counters,
        health: Callable[[], dict[str, Any]],
        curve: Curve | None,
        shm: ShmReceive | None,
    ) -> None:
        self._mailbox = mailbox
        self._loop = loop
        self._stop_refusals: Callable[[], None] | None = None
        self._hwm, self._max_message_bytes, self._curve, self._counters = hwm, max_message_bytes, curve, counters
        self._handler: Callable[[], None] | None = None  # what the driver calls when the socket is readable
        self._rebinding = False  # the old ROUTER is closed, the new one not bound yet
        counters.add("rebinds", 0)
        #: The ROUTER itself: for the driver only; replaced when bound anew.
        self.socket = self._open(bind_endpoint)
        self.endpoint: str = self.socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.protocol = ReceiveProtocol(
            endpoint=self.endpoint,
            incarnation=incarnation,
            decode=decode,
            decode_each=decode_each,
            max_message_bytes=max_message_bytes,
            max_frames=max_frames,
            max_key_bytes=max_key_bytes,
            ack_delay_s=ack_delay_s,
            counters=counters,
            shm=shm,
        )
        self._health = health
        self._shm = shm
        #: ZeroMQ's descriptor for the socket: polling it touches no socket (the driver watches it).
        self.fd: int = self.socket.getsockopt(zmq.FD)
        self._poll_in = [(self.socket, zmq.POLLIN)]
        # A message of up to max_frames frames is kept whole (after its header); past it the socket is bound anew.
        self._reader = RoutedReader(self.socket, max_frames + 1, max_frames)
        self._turn_until = 0.0  # the read deadline every read of this driver turn shares
        self._budget_turn = -1  # the driver's turn that ``_turn_until`` is of

    def _open(self, endpoint: str) -> Any:
        sock, self._stop_refusals = open_router(
            self._loop,
            endpoint,
            hwm=self._hwm,
            max_message_bytes=self._max_message_bytes,
            curve=self._curve,
            counters=self._counters,
        )
        return sock

    def _stop_watching(self) -> None:
        if self._stop_refusals is not None:
            self._stop_refusals()
            self._stop_refusals = None

    def watch(self, handler: Callable[[], None]) -> None:
        """Have the driver call ``handler`` when the socket is readable (the socket bound anew too)."""
        self._handler = handler
        self._loop.add_reader(self.fd, handler)

    def unwatch(self) -> None:
        """Stop the driver watching the socket (before closing it)."""
        self._handler = None
        self._loop.remove_reader(self.fd)

    def read(self) -> bool:
        """Read what is queued, at most one drain; True when it left ZeroMQ holding nothing for us."""
        if self._rebinding:
            return True
        reader, protocol, mailbox, poll_in = self._reader, self.protocol, self._mailbox, self._poll_in
        now = time.monotonic()
        until = self._read_until(now)
        receive = protocol.receive
        drained = False
        for _ in range(_MAX_DRAIN):
            if mailbox.closed:  # close waits for the socket: leave it now
                break
            message = reader.read(until)
            if message is None:
                if reader.overflowed:
                    self._rebind()
                    drained = True
                elif not reader.reading:  # (mid-message: the rest of it next turn)
                    drained = True
                break
            receive(*message, now)
            if protocol.asked:  # a PING or a HEALTH: answered now
                self._answer(now)
            if not _zmq_poll(poll_in, 0):
                drained = True
                break
            if time.monotonic() > until:  # costly messages (many frames): the rest next turn
                break
        # Scheduled before the store (a settle sends what is due now; the driver times the rest): a get
        # the store wakes finds the flush due and leaves its take to that flush, waking no driver.
        if protocol.schedule(now) is not None:
            mailbox.flush_pending = True
        self._store(now)
        return drained

    def _read_until(self, now: float) -> float:
        """When reading stops this turn: one budget for every read of a driver turn, on the driver's thread."""
        loop = self._loop
        if not loop.in_loop():  # (before a loop drives it: each read its own budget)
            return now + _DRAIN_BUDGET_S
        if loop.turn != self._budget_turn:
            self._budget_turn, self._turn_until = loop.turn, now + _DRAIN_BUDGET_S
        return self._turn_until

    def _rebind(self) -> None:
        """Close the ROUTER (the message past ``max_frames`` goes with it) and bind a new one on its endpoint."""
        self._counters.add("rebinds")
        log.warning(
            "receiver %s: a peer sent a message of more than %d frames; the socket is bound anew",
            self.endpoint,
            self._reader.max_frames,
        )
        handler = self._handler
        self._loop.remove_reader(self.fd)
        self._stop_watching()
        self._let_go(self._reader.give_up())
        close_socket(self.socket, linger_ms=_REBIND_LINGER_MS)
        # Off the driver's thread and in short steps (the loop's thread allocates from the same heap), once for a
        # burst of rebinds: the ~640 MB libzmq held for the message go back to the OS.
        trim_malloc_later(_TRIM_AFTER_S)
        self._rebinding = True
        self._reopen(time.monotonic() + _REBIND_S, handler)

    def _let_go(self, frames: list[Any]) -> None:
        """Drop a given-up message's frames a slice a driver turn (65,536 frames at once: 10-25 ms)."""
        del frames[-_LET_GO_FRAMES:]
        if frames:
            self._loop.call_soon(lambda: self._let_go(frames))

    def _reopen(self, give_up_at: float, handler: Callable[[], None] | None) -> None:
        """Bind the new ROUTER once the old listener is gone; retried on the driver until ``give_up_at``."""
        if self._mailbox.closed:  # closing: nothing to bind for
            return
        try:
            sock = self._open(self.endpoint)
        except ZmqOmniError as exc:
            if time.monotonic() < give_up_at:
                self._loop.call_later(_REBIND_RETRY_S, lambda: self._reopen(give_up_at, handler))
            else:
                log.error("receiver %s: could not bind again: %s", self.endpoint, exc)
            return
        self.socket, self._rebinding = sock, False
        self.fd = sock.getsockopt(zmq.FD)
        self._poll_in = [(sock, zmq.POLLIN)]
        self._reader = RoutedReader(sock, self._reader.keep, self._reader.max_frames)
        if handler is not None and self._handler is handler:
            self._loop.add_reader(self.fd, handler)
            self._loop.call_soon(handler)  # what reconnected senders sent meanwhile (its signal may be spent)

    def _answer(self, now: float) -> None:
        """Answer the PINGs and HEALTH requests the protocol holds: the I/O they need, then the replies."""
        protocol, shm = self.protocol, self._shm
        self._store(now)  # what a pong reports arrived is in the mailbox first
        self.hand_over()  # and it tells every consumption not yet told
        verdicts = None if shm is None else {(p[0], p[1]): shm.probe(p) for p in protocol.probes()}
        protocol.answer(verdicts, self._health() if protocol.wants_health() else None)
        replies, protocol.replies = protocol.replies, []
        self.send(replies)

    def _store(self, now: float) -> None:
        """Put the arrivals read so far in the mailbox."""
        protocol = self.protocol
        if protocol.arrivals:
            arrivals, protocol.arrivals = protocol.arrivals, []
            self._mailbox.store(arrivals, now)

    def settle(self, rounds: int = _SETTLE_ROUNDS) -> bool:
        """Send the acks due, and read until ZeroMQ holds nothing for us; True if it does.

        ``rounds`` drains at most: False leaves more queued (the caller hands it to the driver's next turn).
        A drain that found the queue empty is taken at its word unless acks went out after it.
        """
        assert self._loop.owns_sockets_here(), "the receiving socket used off its driver"
        mailbox, protocol = self._mailbox, self.protocol
        drained, drains = False, 0
        while not mailbox.closed:
            due = protocol.flush_due
            if due is not None and due <= time.monotonic():
                self.flush()
                drained = False  # a send may spend ZeroMQ's signal of what came meanwhile: ask again
            if drained:
                return True
            if drains == rounds:
                return self._rebinding or not _zmq_poll(self._poll_in, 0)
            drained = self.read()
            drains += 1
            if self._reader.reading and not self._rebinding:  # a long message: its rest on the driver's next turn
                return False
        return True

    def flush(self, *, still_pending: bool = False) -> None:
        """Send every acknowledgement owed (``still_pending``: see :meth:`hand_over`)."""
        self.hand_over(still_pending=still_pending)
        self.send(self.protocol.flush())

    def hand_over(self, *, still_pending: bool = False) -> None:
        """Give the protocol what left the mailbox since the last hand-over.

        ``still_pending``: a next flush is timed at once, so a take meanwhile need not wake the driver.
        """
        self.protocol.taken(*self._mailbox.handover(still_pending=still_pending))

    def send(self, replies: Iterable[Reply], refused: list[Reply] | None = None) -> tuple[int, int]:
        """Send ``replies`` without waiting; how many ZeroMQ refused as unroutable and as full.

        Each refusal is told to the protocol (and the unroutable ones appended to ``refused``). Unroutable:
        a sender whose control socket is not connected yet, reconnecting, or gone; full: a sender not
        reading its acknowledgements.
        """
        sock, sent = self.socket, self.protocol.sent
        unroutable = full = 0
        for reply in replies:
            if self._rebinding:  # no socket: as unroutable as a sender reconnecting
                sent(reply, False)
                continue
            try:
                sock.send_multipart([reply.identity, reply.frame], zmq.NOBLOCK)
                routed = True
            except zmq.ZMQError as exc:
                routed = False
                if exc.errno == zmq.EAGAIN:
                    full += 1
                else:
                    unroutable += 1
                    if refused is not None:
                        refused.append(reply)
            sent(reply, routed)
        return unroutable, full

    def close(self) -> None:
        """The last acknowledgements (every consumption not yet confirmed), then the socket.

        A sender whose control socket has not reached this incarnation yet (no REPLY to it was ever
        routed: it is reconnecting, as after a restart) would resend what it was not told to the
        next incarnation, which would deliver it again. So on an I/O thread the last acknowledgements
        to such senders are retried until they route or ``_LAST_WORDS_WAIT_S`` passes (libzmq gives no
        event for a peer's routing identity arriving short of a monitor: it looks every
        ``_LAST_WORDS_RETRY_S``); those still refused then, or on an event loop (which must not
        wait here), are logged as a WARNING (their puts may come again). A sender that was routed to
        before and is unroutable now is gone: it reported its own unconfirmed puts at its close.
        """
        assert self._loop.owns_sockets_here(), "the receiving socket closed off its driver"
        if self._stop_refusals is not None:
            self._stop_refusals()
        self.hand_over()
        refused: list[Reply] = []
        flushed = self.send(self.protocol.flush(), refused)
        last = self.send(self.protocol.last_words(), refused)
        unroutable, full = flushed[0] + last[0], flushed[1] + last[1]
        owed = [r for r in refused if r.source is not None and not r.source.confirmed and r.consumed]
        gone = unroutable - len(owed)  # (a sender routed to before and not now)
        if owed and self._loop.threaded:
            owed = self._retry_last_words(owed)
        if full:
            log.warning(
                "%s closed: %d of its last acknowledgement(s) found a sender's queue full; those senders are "
                "not told of the arrivals and consumptions they carried (they resend to the next incarnation)",
                self.endpoint,
                full,
            )
        if owed:
            log.warning(
                "%s closed: %d of its last acknowledgement(s) (%d consumption(s)) found no route to a sender "
                "not yet reconnected to it; it may resend those puts to the next incarnation, delivered again",
                self.endpoint,
                len(owed),
                sum(len(r.consumed) for r in owed),
            )
        if gone:
            log.info("%s closed: %d of its last acknowledgement(s) found a sender gone", self.endpoint, gone)
        # A running event loop does not wait here for the listener to go: its aclose awaits that (aio._closing).
        on_a_loop = not self._loop.threaded and self._loop.in_loop()
        close_bound(self.socket, self.endpoint, linger_ms=200, wait_s=0.0 if on_a_loop else 1.0)

    def _retry_last_words(self, owed: list[Reply]) -> list[Reply]:
        """Send ``owed`` again until each routes or ``_LAST_WORDS_WAIT_S`` passes; those still refused."""
        sock, deadline = self.socket, time.monotonic() + _LAST_WORDS_WAIT_S
        while owed and not self._rebinding and time.monotonic() < deadline:
            time.sleep(_LAST_WORDS_RETRY_S)
            left = []
            for reply in owed:
                try:
                    sock.send_multipart([reply.identity, reply.frame], zmq.NOBLOCK)
                except zmq.ZMQError:
                    left.append(reply)
            owed = left
        return owed

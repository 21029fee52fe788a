"""Push mode, receiving half: the bound ROUTER and what its driver does with it.

:class:`ReceiveSocket` reads messages into the
:class:`~zmq_omni.transport._receive_protocol.ReceiveProtocol`, stores what
arrived in the :class:`~zmq_omni.transport._mailbox.Mailbox`, sends the
protocol's replies and the acknowledgements due, and closes the socket. Every
method but the constructor runs on the driver alone (the endpoint's I/O thread,
or the event loop that owns it), and asserts it: ``Driver.owns_sockets_here``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import zmq

from ..metrics import Counters
from ._loop import Driver
from ._mailbox import Mailbox
from ._push_protocol import _MAX_DRAIN
from ._receive_protocol import ReceiveProtocol, Reply
from ._router import recv_routed
from ._security import Curve, watch_refusals
from ._shm import ShmReceive
from ._sockets import bind, close_bound, close_socket, make_socket

__all__ = ["ReceiveSocket"]

# Whether the socket holds messages: a zero-timeout ``zmq_poll``, which reads ``ZMQ_EVENTS`` as
# ``sock.get(zmq.EVENTS)`` does (resetting the descriptor alike), without pyzmq's option-enum lookup
# (about 1 us less a look, one a drain).
_zmq_poll = zmq.zmq_poll
# A drain's time, whatever its messages cost: a peer sending messages of a thousand frames (each read
# frame by frame, ~2.5 us a frame) must not hold an event loop's turn for its 512 messages (1.2 s).
_DRAIN_BUDGET_S = 0.01
_SETTLE_ROUNDS = 4  # drains a settle does before it leaves the rest of a flood to the driver's next turn


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
        #: The ROUTER itself: for the driver only.
        self.socket = make_socket(loop.ctx, zmq.ROUTER, hwm=hwm, max_message_bytes=max_message_bytes)
        try:
            if curve is not None:
                curve.make_server(self.socket)
                # Stopped by whoever closes the socket, holding it (the monitor is the socket's too).
                self._stop_refusals = watch_refusals(loop, self.socket, counters, stop_on_stop=False)
            self.endpoint = bind(self.socket, bind_endpoint)
        except BaseException:
            if self._stop_refusals is not None:
                self._stop_refusals()
            close_socket(self.socket)
            raise
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

    def read(self) -> bool:
        """Read what is queued, at most one drain; True when it left ZeroMQ holding nothing for us."""
        sock, protocol, mailbox, poll_in = self.socket, self.protocol, self._mailbox, self._poll_in
        now = time.monotonic()
        receive, max_frames = protocol.receive, protocol.max_frames
        drained = False
        for _ in range(_MAX_DRAIN):
            if mailbox.closed:  # close waits for the socket: leave it now
                break
            message = recv_routed(sock, max_frames)
            if message is None:
                drained = True
                break
            receive(*message, now)
            if protocol.asked:  # a PING or a HEALTH: answered now
                self._answer(now)
            if not _zmq_poll(poll_in, 0):
                drained = True
                break
            if time.monotonic() - now > _DRAIN_BUDGET_S:  # costly messages (many frames): the rest next turn
                break
        self._store(now)
        protocol.schedule(now)  # (a settle sends what is due now; the driver times the rest)
        return drained

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
                return not _zmq_poll(self._poll_in, 0)
            drained = self.read()
            drains += 1
        return True

    def flush(self) -> None:
        """Send every acknowledgement owed."""
        self.hand_over()
        self.send(self.protocol.flush())

    def hand_over(self) -> None:
        """Give the protocol what left the mailbox since the last hand-over."""
        self.protocol.taken(*self._mailbox.handover())

    def send(self, replies: Iterable[Reply]) -> None:
        sock, sent = self.socket, self.protocol.sent
        for reply in replies:
            try:
                sock.send_multipart([reply.identity, reply.frame], zmq.NOBLOCK)
                routed = True
            except zmq.ZMQError:  # unroutable (a sender whose control socket is not connected yet, or gone) or full
                routed = False
            sent(reply, routed)

    def close(self) -> None:
        """The last acknowledgements (every consumption not yet confirmed), then the socket."""
        assert self._loop.owns_sockets_here(), "the receiving socket closed off its driver"
        if self._stop_refusals is not None:
            self._stop_refusals()
        self.flush()
        self.send(self.protocol.last_words())
        # A running event loop does not wait here for the listener to go: its aclose awaits that (aio._closing).
        on_a_loop = not self._loop.threaded and self._loop.in_loop()
        close_bound(self.socket, self.endpoint, linger_ms=200, wait_s=0.0 if on_a_loop else 1.0)

"""Push mode, sending half: what the connector's I/O thread does for a :class:`~zmq_omni.transport.PushSender`.

It owns every control socket and reads the receivers' REPLYs (acknowledgements
and pongs), resends what a pong or a restart says was lost, pings at each beat,
when put threads wait for acks and as it meets a receiver (for the shm verdict;
see :mod:`~zmq_omni.transport._shm`), makes the shm pool's first slot once a
receiver reads our memory, fails puts past their delivery deadline,
flushes outboxes a put thread left queued, and closes the sockets at stop. It
sends on a data socket only when it can take that socket's ``data_lock``
without waiting: a put thread may be blocked at the high-water mark, and the
next beat or pong retries. The table in :mod:`~zmq_omni.transport._sender`
lists every lock and flag and who takes it.
"""

from __future__ import annotations

import logging
import time

import zmq

from ..errors import DecodeError, TransportError, format_seconds
from ..wire import brief
from ._batching import STREAM_FLUSH_S, batch_end
from ._envelope import Kind, check_ranges, check_types, unpack
from ._push_protocol import _MAX_DRAIN
from ._send_window import Out
from ._sender_core import Peer, SenderCore
from ._sockets import close_socket, make_socket

__all__ = ["NEARLY_FULL", "SenderIo"]

#: A window holding this share of ``max_unacked`` (or of its bytes) is nearly full (``stats()["window_high_s"]``).
NEARLY_FULL = 0.9

log = logging.getLogger("zmq_omni.transport")

_REPLY_TYPES = (str, int, list, list)
_VERDICT_TYPES = (type(None), bool)
# Receivers acknowledge lazily (ack_delay_s, 20 ms: no ack traffic beside a lone message). A sender
# that needs acks sooner, its window full or a flush() waiting, pings its receivers, which answer at
# once; and again after 2, 4, 8 ... ms (at most every 100 ms) while the need lasts, since a pong
# may have left just before the consumption that would have freed the window.
_ACK_REQUEST_S = 0.002
_ACK_REQUEST_MAX_S = 0.1
# While puts are on their way, how often (and how many times) to look for a moment to make the shm pool's first slot.
_PREPARE_RETRY_S = 0.01
_PREPARE_RETRY_MAX_S = 1.0
_PREPARE_TRIES = 10
# At stop, how long to wait for a put thread to let go of a data socket (it notices close() within a send slice).
_CLOSE_WAIT_S = 0.5


class SenderIo:
    """The I/O thread's handlers and timers for one push sender (every method runs on that thread).

    Args:
        core: the state shared with the put threads.
        heartbeat_s: how often to ping every receiver.
        peer_timeout_s: a receiver silent this long is presumed gone.
        delivery_timeout_s: how long a put may stay unarrived (for the failure's message; the window decides).
    """

    def __init__(self, core: SenderCore, *, heartbeat_s: float, peer_timeout_s: float, delivery_timeout_s: float):
        self._core = core
        self._peer_timeout = peer_timeout_s
        self._delivery_timeout = delivery_timeout_s
        self._preparing = False  # a _prepare_slot chain is scheduled
        loop = core.loop
        loop.every(heartbeat_s, self._heartbeat)
        loop.every(min(0.05, heartbeat_s), self._expire)
        loop.on_stop(self.close_sockets)

    def add_peer(self, peer: Peer) -> None:
        """Serve a new peer: its control socket, and a first PING for the shm verdict (any thread)."""
        loop = self._core.loop
        peer.flush_soon = lambda: self.flush(peer)
        loop.call_soon(lambda: self._open_ctl(peer))
        if self._core.probe is not None:
            loop.call_soon(lambda: self._ask_verdict(peer))  # learn the shm verdict before the first beat

    # -- acknowledgements -------------------------------------------------------------------
    def ask_for_acks(self, delay: float = _ACK_REQUEST_S) -> None:
        """Ping every receiver, and again after ``delay`` (doubling) while the window stays full or a flush waits."""
        core = self._core
        with core.lock:
            window = core.window
            wanted = window.full(core.room_wanted) or (core.delivery_waiters > 0 and window.undelivered() > 0)
            if not wanted or core.closed:
                core.acks_wanted = False
                return
            peers = list(core.peers.values())
        again = min(2 * delay, _ACK_REQUEST_MAX_S)
        # Scheduled first: acks_wanted stays True until a later call finds no need, so a chain that
        # stopped here would leave every later full window without an ack request.
        core.loop.call_later(delay, lambda: self.ask_for_acks(again))
        for peer in peers:
            self.ping(peer)

    def _open_ctl(self, peer: Peer) -> None:
        core = self._core
        if core.closed or peer.ctl_sock is not None:
            return
        try:
            sock = make_socket(core.loop.ctx, zmq.DEALER, hwm=core.hwm, identity=b"c" + core.sid.encode())
        except zmq.ZMQError as exc:  # (out of sockets or descriptors): the next heartbeat tries again
            self._failing(peer, f"no control socket to {peer.endpoint} yet: {exc}")
            return
        try:
            if core.curve is not None and peer.server_key is not None:
                core.curve.make_client(sock, peer.server_key)
            sock.connect(peer.endpoint)
        except zmq.ZMQError as exc:
            close_socket(sock)
            self._failing(peer, f"no control socket to {peer.endpoint} yet: {exc}")
            return
        peer.ctl_sock = sock
        core.loop.add_reader(sock, lambda: self._on_ctl(peer))

    def _on_ctl(self, peer: Peer) -> None:
        core = self._core
        limit = 4 * core.window.max_count + 1024
        for _ in range(_MAX_DRAIN):
            try:
                frames = peer.ctl_sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                kind, header, _ = unpack(frames[0])
                if kind is not Kind.REPLY or len(frames) != 1:
                    raise DecodeError(f"unexpected {kind.name} message on the control socket")
                check_types(header[:4], _REPLY_TYPES, "REPLY")
                verdict = header[4] if len(header) > 4 else None
                if type(verdict) not in _VERDICT_TYPES:
                    raise DecodeError(f"REPLY shm verdict {brief(verdict)} is not a bool or null")
                batch_bytes = header[5] if len(header) > 5 else 0
                if type(batch_bytes) is not int or batch_bytes < 0:
                    raise DecodeError(f"REPLY batch size {brief(batch_bytes)} is not a count of bytes")
                arrived, consumed = check_ranges(header[2], limit), check_ranges(header[3], limit)
                self._on_reply(peer, header[0], header[1], arrived, consumed, verdict, batch_bytes)
            except DecodeError as exc:
                core.counters.add("rejected_frames")
                log.warning("rejected a reply from %s: %s", peer.endpoint, exc)

    def _on_reply(
        self,
        peer: Peer,
        incarnation: str,
        ping: int,
        arrived: list[range],
        consumed: list[range],
        shm: bool | None,
        batch_bytes: int,
    ) -> None:
        """Apply a REPLY to the window, then resend what it says was lost."""
        core = self._core
        now = time.monotonic()
        with core.lock:
            win = peer.win
            verdict = win.shm
            result = core.window.apply_reply(win, incarnation, ping, arrived, consumed, shm, batch_bytes, now)
            if result.restarted:
                log.info("receiver %s restarted (%s); resending %d puts", peer.endpoint, incarnation, len(win.retained))
            reads = win.shm is True and verdict is not True
            if win.shm is not None and win.shm != verdict:
                log.info("receiver %s %s our shared memory", peer.endpoint, "reads" if win.shm else "cannot read")
            if result.changed or result.freed or core.delivery_waiters:
                core.cv.notify_all()
            if arrived and core.cv.listener is not None:
                # Arrivals drained ZeroMQ's queue: a non-blocking put refused at the high-water mark may go now.
                core.cv.listener()
        if reads and not self._preparing:
            self._preparing = True
            self._prepare_slot()
        if result.disposed:  # the receiver dropped them unconsumed, and says why: each put failed
            core.report_disposed(peer, ping, result.disposed)
        if result.resend:
            self._resend(peer, result.resend)

    def _resend(self, peer: Peer, outs: list[Out]) -> None:
        core = self._core
        if not peer.data_lock.acquire(False):
            return  # a put thread holds the socket: the next pong retries what is still unacknowledged
        try:
            if core.closed:
                return
            sock = peer.socket()
            with core.lock:  # what is still unarrived now, the low mark to send with it, and whom it is for
                win = peer.win
                live = [o for o in outs if o.seq in win.unarrived]
                low = win.low
                batch_bytes = win.batch_bytes
                # Tagged: if this incarnation closes with them still queued, the next one drops them
                # (the first copy may have been delivered here) and we resend when we hear it.
                target = win.incarnation
            small = [o for o in live if batch_bytes and core.batchable(o)]
            large = [o for o in live if not (batch_bytes and core.batchable(o))]
            sent = 0
            try:
                start = 0
                while start < len(small):
                    end = batch_end(small, start, batch_bytes, peer.to_stage, core.batch_max_messages)
                    peer.transmit_batch(sock, small[start:end], low, target)
                    sent += end - start
                    start = end
                for out in large:
                    peer.transmit(sock, out, low, target)
                    sent += 1
            except zmq.ZMQError:
                pass  # full or gone: the next pong retries what is still unacknowledged
            if sent:
                core.counters.add("resends", sent)
        finally:
            peer.release()

    def _prepare_slot(self, delay: float = _PREPARE_RETRY_S, tries: int = _PREPARE_TRIES) -> None:
        """Make the shm pool's first slot, for the first large put, at a moment no put of ours is on its way.

        Creating it costs about 1 ms of CPU per MiB (on this thread: in ``aio`` mode it holds the event
        loop that long): made while a put is on its way (a put right after start), it would slow
        that put down. On its way, as this thread can see it: admitted and not yet arrived at its
        receiver (a put still encoding or writing its own slot is not admitted yet; if one takes
        the pool's lock first, the slot made here is simply the second). It looks again after 10,
        20, 40 ... ms (at most every second), ``tries`` times in all (about 4 s), then leaves the
        slot to the first large put; it stops once the pool has a slot. One such chain at a time,
        whatever the number of receivers that prove they read our memory meanwhile.
        """
        core, shm = self._core, self._core.shm
        if shm is None or core.closed or shm.stats()["slots"]:
            self._preparing = False
            return
        with core.lock:
            busy = any(peer.win.unarrived for peer in core.peers.values())
        if busy and tries > 1:
            again = min(2 * delay, _PREPARE_RETRY_MAX_S)
            core.loop.call_later(delay, lambda: self._prepare_slot(again, tries - 1))
            return
        self._preparing = False
        if not busy:
            shm.prepare_slot()

    # -- the outbox -------------------------------------------------------------------------
    def flush(self, peer: Peer) -> None:
        """Send everything queued for ``peer``.

        Puts found queued mean a stream is on: it sends them and keeps the peer busy for another
        ``STREAM_FLUSH_S``, so the stream's next puts queue too (the first of them schedules the next flush).
        """
        core = self._core
        box = peer.box
        with core.lock:
            box.flush_armed = False
            box.blocked = False
            if not box.items or core.closed:
                return
        if not peer.data_lock.acquire(False):
            return  # the holder's release() re-arms this flush
        try:
            streaming = peer.send_batches(None)
        finally:
            peer.release()
        if streaming:
            with core.lock:
                box.busy_until = time.monotonic() + STREAM_FLUSH_S

    # -- beats and deadlines ----------------------------------------------------------------
    def _heartbeat(self) -> None:
        core = self._core
        now = time.monotonic()
        with core.lock:
            window = core.window
            if window.count >= NEARLY_FULL * window.max_count or window.nbytes >= NEARLY_FULL * window.max_bytes:
                if core.high_since is None:
                    core.high_since = now
            else:
                core.high_since = None
            peers = list(core.peers.values())
            for peer in peers:
                at_risk = window.note_silence(peer.win, now, self._peer_timeout)
                if at_risk:
                    log.warning(
                        "receiver %s silent for %.1fs; %d delivered puts at risk",
                        peer.endpoint,
                        now - peer.win.last_heard,
                        at_risk,
                    )
        for peer in peers:
            if peer.ctl_sock is None:  # its first try failed: without it, no REPLY would ever be read
                self._open_ctl(peer)
            self.ping(peer)

    def ping(self, peer: Peer) -> bool:
        """Send ``peer`` a PING now, unless a put thread holds its socket (the next beat or ack request pings).

        Returns:
            False when the socket was held (nothing sent).
        """
        core = self._core
        with core.lock:
            if not peer.data_lock.acquire(False):
                return False
            low = peer.win.low
        try:
            if not core.closed:
                peer.send_ping(peer.socket(), low)
        except TransportError as exc:  # no data socket (out of descriptors, or an endpoint ZeroMQ refuses)
            # One peer's socket must not stop the beat, or the ack requests, of the peers after it.
            self._failing(peer, f"cannot ping {peer.endpoint}: {exc}")
        finally:
            peer.release()
        return True

    @staticmethod
    def _failing(peer: Peer, message: str) -> None:
        """Log a socket error of ``peer``'s once (a WARNING), then at DEBUG while every beat retries it."""
        if peer.io_failing:
            log.debug("%s", message)
        else:
            peer.io_failing = True
            log.warning("%s (retried each beat; logged once)", message)

    def _ask_verdict(self, peer: Peer, delay: float = _ACK_REQUEST_S) -> None:
        """The first PING to a receiver, for its shm verdict: retried soon, not at the next beat, while a put sends.

        The first put to a receiver met at that put holds the data socket as this PING falls due:
        left to the beat, the verdict would come ``heartbeat_s`` later and the puts until then go as
        frames. Retried after 2, 4, 8 ... ms (at most every 100 ms) until it leaves.
        """
        if not self.ping(peer) and not self._core.closed:
            again = min(2 * delay, _ACK_REQUEST_MAX_S)
            self._core.loop.call_later(delay, lambda: self._ask_verdict(peer, again))

    def _expire(self) -> None:
        core = self._core
        now = time.monotonic()
        with core.lock:
            failed = [(core.peers[win.to_stage], out) for win, out in core.window.expire(now)]
            if failed:
                core.cv.notify_all()
            # Why, read now: the incarnation is the window's (under this lock).
            answered = {peer.to_stage: peer.win.incarnation is not None for peer, _ in failed}
        for peer in {peer for peer, _ in failed}:
            # Drop what ZeroMQ still queues for this peer, so a put reported failed is never delivered later.
            if peer.data_lock.acquire(False):
                try:
                    peer.close_socket()
                finally:
                    peer.release()
        core.report_lost(
            failed,
            lambda peer: (
                f"delivery to stage {peer.to_stage!r} not confirmed within {format_seconds(self._delivery_timeout)} "
                f"(receiver {'gone or not acknowledging' if answered[peer.to_stage] else 'never answered'})"
            ),
        )

    # -- stop -------------------------------------------------------------------------------
    def close_sockets(self) -> None:
        """Close every socket (the loop's last act): a data socket a put thread still holds, its holder closes."""
        core = self._core
        with core.lock:
            peers = list(core.peers.values())
        for peer in peers:
            if peer.ctl_sock is not None:
                core.loop.remove_reader(peer.ctl_sock)
                close_socket(peer.ctl_sock)
            if not peer.data_lock.acquire(timeout=_CLOSE_WAIT_S):
                with core.lock:
                    if not peer.data_lock.acquire(False):
                        peer.close_pending = True  # closed by Peer.release
                        continue
            try:
                peer.close_socket()
            finally:
                peer.release()

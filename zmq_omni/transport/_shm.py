"""The same-host fast path of push mode: payloads in the sender's slot pool, a handle on the wire.

Sender (:class:`ShmSend`): one :class:`~zmq_omni.shm.SlotPool`. A payload at
or above the threshold, for a receiver that proved it shares our ``/dev/shm``,
is written once into a slot and only the packed handle (tens of bytes) goes
into the DATA header's ``loc`` field. Resends carry the same handle: the slot
stays READY until the receiver leases it or ``ttl`` passes.

Receiver (:class:`ShmReceive`): one :class:`~zmq_omni.shm.SlotReader`. The
handle waits in the mailbox like any item and is opened at ``get`` (so a
receiver that dies before ``get`` leaves the slot READY for the resend to its
successor); the decoded arrays view the slot and hold its lease.

Same-host detection: the sender creates a small probe segment holding a random
nonce and names it in every PING; the receiver attaches it *in its own shm
directory* and compares the nonce. Another host, another container without
``--ipc=host``, or another ``shm_dir`` cannot read it, so the verdict is
``false`` and that receiver keeps getting ordinary frames.

The verdict from the first put on. A pipeline's first large put (vllm-omni's
chunk 0, the prompt's hidden states, ~1 MiB) is the first request's, so the
verdict must be in before it, and so must a slot to write into:

* **Met at construction.** A push sender that can name its receivers
  (``to_stage``; without it, every other stage of ``endpoints`` for a
  ``sender`` or ``dual`` connector, as vllm-omni's stage 0 is; never the stage
  it binds itself, and none over CURVE: see ``connectors/_zmq_puts.py``)
  connects to them and pings them as it is built (``PushSender.meet``): the verdict comes
  a few ms later, long before a stage that loads a model serves a request. A
  receiver that is not up yet gets the PING ZeroMQ queued for it once it binds
  and our sockets reconnect (within a second), or the next beat's if its
  answer found our control socket not connected yet.
* **Met at the first put, answered at once.** A sender that cannot name its
  receivers meets each at its first put to it. That put holds the data socket
  as the first PING falls due; the PING is tried again after 2, 4, 8 ... ms
  (``SenderIo._ask_verdict``), not left to the next beat (``heartbeat_s``), so
  the next large put, a few ms later, has the verdict.
* **No put waits for a verdict** (``auto``; ``on`` waits up to
  ``put_timeout_s``). Measured (``benchmarks/first_put.py``, 1 MiB, two
  processes, 2 cores): the verdict takes 2-4 ms from meeting the receiver,
  and 1 MiB goes as frames over ``ipc://`` in about 1-1.5 ms put->get; a first
  put made right after construction that waited up to 20 ms for the verdict
  arrived after 5.3 ms, against 1.9 ms as frames. A put that finds no verdict
  goes as frames, exactly as to a receiver on another host.
* **A slot made before the put.** Creating and faulting in a segment costs
  about 1 ms per MiB (more under load): a first put into a new segment is
  slower through shared memory than as frames (2.3 against 0.8 ms put->get for
  1 MiB). So once a receiver proves it reads our memory, the I/O thread makes
  the pool's first slot (:meth:`ShmSend.prepare_slot`: four times the
  threshold, at most 8 MiB; 2 MiB by default, which any payload from the
  threshold up to that size uses), at a moment no put of ours is on its way
  (the CPU it takes would slow that put down; ``SenderIo._prepare_slot`` says
  how long it looks for one). One slot only: the pool grows by the
  puts' own sizes from then on, and a put of a size no free slot fits still
  makes its segment on its own path.

The other way, sending the first large put through shared memory before the
verdict and falling back to frames when the receiver cannot attach, would need
a refusal in the receive protocol, a resend of the slot's bytes as frames, and
would put a cold segment on the first put's path, which is the slow part.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from typing import Any

from ..errors import DecodeError, ShmError
from ..shm import Segment, SlotHandle, SlotPool, SlotReader, parse_name
from ..wire import brief

__all__ = ["ShmReceive", "ShmSend", "check_probe"]

log = logging.getLogger("zmq_omni.transport")

NONCE_BYTES = 16
#: The largest slot :meth:`ShmSend.prepare_slot` makes before any put asked for one.
PREPARED_SLOT_MAX = 8 << 20
_MAX_NAME = 255


class ShmSend:
    """The sender's pool and probe. Thread-safe (the pool locks; the probe is immutable)."""

    def __init__(
        self, *, directory: str | None, threshold: int, max_bytes: int, min_free_bytes: int, ttl_s: float
    ) -> None:
        self.threshold = threshold
        self.pool = SlotPool(
            directory=directory,
            max_bytes=max_bytes,
            min_free_bytes=min_free_bytes,
            min_slot_bytes=min(threshold, 256 << 10),  # a low threshold must not park 8 KiB in 256 KiB slots
            ttl=ttl_s,
        )
        self.directory = self.pool.directory
        self.error: str | None = None
        self.probe: list[Any] | None = None
        self._probe_seg: Segment | None = None
        try:
            seg = Segment.create(4096, directory=self.directory)
        except (ShmError, OSError) as exc:
            self.error = f"no probe segment in {self.directory}: {exc}"
            log.warning("shared-memory fast path off: %s", self.error)
            return
        nonce = os.urandom(NONCE_BYTES)
        seg.mm[:NONCE_BYTES] = nonce
        self._probe_seg = seg
        self.probe = [seg.name, nonce]

    def prepare_slot(self) -> None:
        """Create the pool's first slot (four times the threshold, at most 8 MiB) unless it has one (the I/O thread).

        Called when a receiver first proves it reads our memory, so that the first large put finds a
        slot ready instead of creating and faulting in a segment on its own path.
        """
        capacity = min(4 * self.threshold, PREPARED_SLOT_MAX)
        if capacity < self.threshold:
            return  # puts this large are rare and their size unknown: the first one makes its slot
        try:
            self.pool.prepare(capacity)
        except (ShmError, OSError) as exc:  # closed, or no segment: the first write tries again, or falls back
            if log.isEnabledFor(logging.DEBUG):
                log.debug("no shared-memory slot prepared: %s", exc)

    def write(self, frames: Sequence[Any]) -> bytes | None:
        """Copy ``frames`` into a slot and return the packed handle, or None (no room: send frames)."""
        try:
            return self.pool.write(frames).pack()
        except ShmError as exc:
            if log.isEnabledFor(logging.DEBUG):
                log.debug("shared-memory slot refused, sending frames: %s", exc)
            return None

    def unopened(self, loc: bytes) -> bool:
        """True while the slot of ``loc`` waits READY for its receiver (not leased, not reclaimed)."""
        try:
            return self.pool.unopened(SlotHandle.unpack(loc))
        except ShmError:
            return False

    def discard(self, loc: bytes) -> None:
        """Free the slot of a put that will never be read (failed, forgotten, expired)."""
        with contextlib.suppress(ShmError):
            self.pool.discard(SlotHandle.unpack(loc))

    def reap(self) -> None:
        """Reclaim expired handles and leases of dead receivers (the I/O thread, about once a second)."""
        with contextlib.suppress(ShmError):  # closed under our feet
            self.pool.reap()

    def stats(self) -> dict[str, int]:
        """The pool snapshot."""
        return self.pool.stats()

    def close(self) -> None:
        """Unlink the probe and every slot (receivers' live views stay valid)."""
        self.pool.close()
        if self._probe_seg is not None:
            self._probe_seg.unlink()
            self._probe_seg.close()
            self._probe_seg = None


def check_probe(probe: Any) -> None:
    """Raise ``DecodeError`` unless ``probe`` is ``[segment name, nonce]`` as a PING carries it."""
    if (
        not isinstance(probe, list)
        or len(probe) != 2
        or type(probe[0]) is not str
        or type(probe[1]) is not bytes
        or len(probe[1]) != NONCE_BYTES
        or len(probe[0]) > _MAX_NAME
    ):
        raise DecodeError(f"bad shared-memory probe {brief(probe)}")


class ShmReceive:
    """The receiver's reader: answers probes, sizes and opens handles."""

    def __init__(self, *, directory: str | None) -> None:
        self.reader = SlotReader(directory=directory)

    def probe(self, probe: Any) -> bool:
        """True when the sender's probe segment is readable here and holds its nonce.

        Raises:
            DecodeError: ``probe`` is not ``[segment name, nonce]``.
        """
        check_probe(probe)
        try:
            seg = Segment.attach(probe[0], directory=self.reader.directory)
        except (ShmError, OSError) as exc:
            log.info("sender's shared memory %s is not readable here (%s): frames only", probe[0], exc)
            return False
        try:
            return bool(bytes(seg.mm[:NONCE_BYTES]) == probe[1])
        finally:
            seg.close()

    @staticmethod
    def size(loc: bytes, probe: Any) -> int:
        """Payload bytes of a packed handle from the sender whose (answered) probe was ``probe``.

        A handle is accepted only for a segment its sender's process created: the owner its
        name encodes (:func:`~zmq_omni.shm.parse_name`) must be the owner of the probe segment,
        which the receiver read and found holding the sender's nonce. A sender whose probe
        passed cannot make a receiver open, lease or free another process's slots.

        Raises:
            DecodeError: the handle is malformed, or names a segment of another process.
        """
        try:
            segment = SlotHandle.unpack(loc)
        except ShmError as exc:
            raise DecodeError(str(exc)) from exc
        owner = parse_name(segment.segment)
        if owner is None or type(probe) is not list or not probe or type(probe[0]) is not str:
            raise DecodeError("a shared-memory handle from a sender whose probe this side did not read")
        if owner != parse_name(probe[0]):
            raise DecodeError(f"a shared-memory handle names segment {brief(segment.segment)}, not one of its sender's")
        return segment.nbytes

    def open(self, loc: bytes) -> list[memoryview] | None:
        """Lease the slot and return its frames as views, or None (expired, withdrawn or gone)."""
        try:
            return self.reader.open(SlotHandle.unpack(loc))
        except (ShmError, OSError) as exc:
            log.info("cannot open a shared-memory handle: %s", exc)
            return None

    def discard(self, loc: bytes) -> None:
        """Free the slot of a handle nobody will get (re-put, cleanup)."""
        with contextlib.suppress(ShmError, OSError):
            self.reader.discard(SlotHandle.unpack(loc))

    def close(self) -> None:
        """Drop cached mappings (leased ones stay until their last view dies)."""
        self.reader.close()

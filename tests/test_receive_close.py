"""Close seals the receive side: nothing is taken after it, waiting gets wake at once, the address is free after it.

* a sealed mailbox refuses every take (fed directly: no thread interleaving to
  hope for), and records no consumption its last acknowledgements could miss;
* on a shared endpoint, a connector's close wakes its own waiting gets at once,
  while the endpoint stays open for the other connector, whose gets go on;
* a close while the receiver decodes a slow payload returns with the socket closed:
  the address binds again at once, and the process's ZeroMQ context is released.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from zmq_omni.connectors.zmq import ZmqConnector
from zmq_omni.transport._mailbox import Mailbox
from zmq_omni.transport._receive_protocol import Item


def _mailbox() -> Mailbox:
    return Mailbox(ack_delay_s=0.02, tombstone_ttl_s=1.0, max_tombstones=8, on_armed=lambda: None)


def test_a_sealed_mailbox_refuses_every_take_and_records_no_consumption() -> None:
    mailbox = _mailbox()
    slot = ("0", "1", "k")
    mailbox.store([(slot, Item("payload", 7, "s", 1, None, 0.0))], 0.0)
    mailbox.close()
    assert mailbox.pop(slot) is None
    with mailbox.lock:
        assert mailbox.pop_locked(slot) is None
    consumed, dropped, nbytes = mailbox.handover()
    assert consumed == [] and dropped == [] and nbytes == 0
    assert mailbox.stats()["gets"] == 0


def test_a_take_before_the_seal_is_in_what_the_seal_hands_over() -> None:
    mailbox = _mailbox()
    slot = ("0", "1", "k")
    mailbox.store([(slot, Item("payload", 7, "s", 1, None, 0.0))], 0.0)
    item = mailbox.pop(slot)
    assert item is not None and mailbox.result(item) == ("payload", 7)
    mailbox.close()
    assert mailbox.handover()[0] == [("s", 1)]

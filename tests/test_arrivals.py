"""Arrival watches and their one registration path (connectors/arrivals.py), without an event loop."""

from __future__ import annotations

import uuid

from zmq_omni.connectors.arrivals import ArrivalWatch, WatchSet
from zmq_omni.connectors.inproc import InProcConnector


def test_a_watch_set_notifies_each_watch_until_it_closes() -> None:
    watches = WatchSet()
    first, second = ArrivalWatch(), ArrivalWatch()
    watches.add(first)
    watches.add(second)
    watches.notify(iter([("0", "1", "k")]))  # an iterator reaches every watch, not only the first
    assert first.drain() == ([("0", "1", "k")], False)
    assert second.drain() == ([("0", "1", "k")], False)
    second.close()
    assert list(watches) == [first]
    first.close()
    assert not watches


def test_a_watch_of_a_shared_mailbox_leaves_it_and_its_connector_when_closed() -> None:
    namespace = uuid.uuid4().hex
    sender, receiver = InProcConnector({"namespace": namespace}), InProcConnector({"namespace": namespace})
    try:
        watch = receiver.watch_arrivals()
        assert sender.put("0", "1", "k", {"x": 1})[0]
        assert watch.drain() == ([("0", "1", "k")], False)  # a put of another connector of the namespace
        watch.close()
        assert not receiver._watches and not receiver._box.watches
    finally:
        sender.close()
        receiver.close()


def test_a_watch_taken_after_close_is_woken_at_once() -> None:
    connector = InProcConnector({"namespace": uuid.uuid4().hex})
    connector.close()
    watch = connector.watch_arrivals()
    try:
        assert watch.drain() == (None, False)  # "anything": the watcher then sees the connector closed
    finally:
        watch.close()


def test_when_closed_runs_at_once_on_a_closed_watch() -> None:
    watch = ArrivalWatch()
    watch.close()
    seen: list[ArrivalWatch] = []
    watch.when_closed(seen.append)
    assert seen == [watch]

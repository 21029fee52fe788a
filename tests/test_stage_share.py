"""The shared stage endpoint's books, without I/O: wants, leases, silent clients, a binder change."""

from __future__ import annotations

import time

from zmq_omni.transport._mailbox import Mailbox
from zmq_omni.transport._receive_protocol import Item
from zmq_omni.transport._stage_share import LeaseBook, WantBook

A, B = b"client-a", b"client-b"
S1 = ("0", "1", "req-1_0_0")
S2 = ("0", "1", "req-2_0_0")


def test_the_first_asker_gets_the_item_and_only_it_can_settle_it() -> None:
    book = LeaseBook(peer_timeout_s=3.0)
    book.want(A, S1, deadline=10.0, now=0.0)
    book.want(B, S1, deadline=10.0, now=0.0)
    assert book.first_wanting(S1) == A and book.first_wanting(S2) is None
    lease = book.lend(A, S1, "item")
    assert lease.client == A and lease.item == "item"
    assert book.first_wanting(S1) == B  # B still waits for a later put of the key
    assert book.settle(B, lease.lease) is None  # not B's lease
    assert book.settle(A, lease.lease) == lease
    assert book.settle(A, lease.lease) is None  # counted once
    assert book.leases_of(A) == []


def test_a_later_ask_moves_the_deadline_and_an_expired_want_is_answered() -> None:
    book = LeaseBook(peer_timeout_s=100.0)
    book.want(A, S1, deadline=1.0, now=0.0)
    book.want(A, S1, deadline=2.0, now=0.5)
    book.want(B, S2, deadline=1.5, now=0.5)
    assert book.next_deadline() == 1.5
    assert book.tick(1.6).wants == [(B, S2)]
    assert book.wanted() == [S1]
    expired = book.tick(2.0)
    assert expired.wants == [(A, S1)] and expired.returned == []
    assert book.wanted() == []


def test_a_silent_client_loses_its_wants_and_its_leases_come_back() -> None:
    book = LeaseBook(peer_timeout_s=3.0)
    book.want(A, S1, deadline=100.0, now=0.0)
    book.want(A, S2, deadline=100.0, now=0.0)
    lease = book.lend(A, S1, "item")
    book.want(B, S2, deadline=100.0, now=2.0)
    book.heard(B, now=3.5)
    expired = book.tick(3.5)
    assert expired.returned == [lease]  # back to the mailbox: the next asker gets it
    assert expired.wants == []  # nobody to answer for A
    assert book.first_wanting(S2) == B and book.leases_of(A) == []


def test_give_back_returns_the_lease_and_cleanup_ends_wants() -> None:
    book = LeaseBook(peer_timeout_s=3.0)
    book.want(A, S1, deadline=100.0, now=0.0)
    book.want(B, S2, deadline=100.0, now=0.0)
    lease = book.lend(A, S1, "item")
    assert book.give_back(A, lease.lease) == lease
    assert book.forget(lambda key: key.startswith("req-2_")) == [(B, S2)]
    assert book.wanted() == []


def test_a_client_tells_the_next_binder_its_open_wants_and_what_it_took() -> None:
    wants = WantBook(remember=2)
    assert wants.want(S1, deadline=5.0)
    assert not wants.want(S1, deadline=4.0)  # the binder already waits longer
    assert wants.want(S1, deadline=6.0)
    assert wants.want(S2, deadline=1.0)
    wants.lent(S1)
    assert wants.want(S1, deadline=9.0)  # a later put of the same key
    for seq in range(3):
        wants.took("sender", seq)
    assert wants.taken_since() == [("sender", 1), ("sender", 2)]  # the last ones only
    # the binder dies; the next one hears the open wants (not the expired one) and the taken puts
    open_wants, taken = wants.rebound(now=2.0)
    assert open_wants == [(S1, 9.0)] and taken == [("sender", 1), ("sender", 2)]
    successor = LeaseBook(peer_timeout_s=3.0)
    assert successor.hello(A, now=2.0, taken=taken) == (taken, [])  # counted consumed when their senders resend them
    for slot, deadline in open_wants:
        successor.want(A, slot, deadline, now=2.0)
    assert successor.first_wanting(S1) == A


def test_a_silent_client_whose_process_lives_keeps_its_leases_and_a_dead_one_loses_them() -> None:
    book = LeaseBook(peer_timeout_s=3.0)
    alive = {100: True, 200: True}
    book.hello(A, now=0.0, taken=[], pid=100)
    book.hello(B, now=0.0, taken=[], pid=200)
    book.want(A, S1, deadline=100.0, now=0.0)
    book.want(B, S2, deadline=100.0, now=0.0)
    lease_a, lease_b = book.lend(A, S1, "a"), book.lend(B, S2, "b")
    expired = book.tick(5.0, alive=alive.__getitem__)
    assert expired.returned == [] and expired.stalled == [A, B]  # stalled, not dead: reported once
    assert book.tick(6.0, alive=alive.__getitem__).stalled == []
    alive[200] = False
    expired = book.tick(7.0, alive=alive.__getitem__)
    assert expired.returned == [lease_b] and book.leases_of(A) == [lease_a]


def test_a_hello_gives_back_the_leases_that_client_still_holds() -> None:
    book = LeaseBook(peer_timeout_s=3.0)
    book.hello(A, now=0.0, taken=[], pid=100)
    book.want(A, S1, deadline=100.0, now=0.0)
    lease = book.lend(A, S1, "item")
    assert book.hello(A, now=1.0, taken=[("sender", 1)], pid=100) == ([("sender", 1)], [lease])
    assert book.leases_of(A) == []


def test_a_put_taken_through_a_previous_binder_is_counted_consumed_whether_its_resend_came_or_comes() -> None:
    for resend_first in (False, True):
        mailbox = Mailbox(tombstone_ttl_s=60.0, max_tombstones=100, on_left=lambda heavy: None)
        resend = [(S1, Item("obj", 3, "sender", 7, None, time.monotonic()))]
        if resend_first:
            mailbox.store(resend, time.monotonic())
        mailbox.consumed_elsewhere([("sender", 7)])
        if not resend_first:
            mailbox.store(resend, time.monotonic())
        assert mailbox.pop(S1) is None  # not delivered again
        assert mailbox.handover()[0] == [("sender", 7)]  # its sender hears it consumed

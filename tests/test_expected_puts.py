"""``ExpectedPuts``: one record per endpoint of this process's puts not arrived yet, before and after the bind."""

from __future__ import annotations

import time
import uuid
from types import SimpleNamespace
from typing import Any, cast

from zmq_omni.connectors._expected_puts import ExpectedPuts, adopt, cancel_early, expect, release, settle

_SHARED = cast(Any, SimpleNamespace(part=None))  # a bound endpoint with no push receiver (nothing to bury)


def _endpoint() -> str:
    return f"ipc:///tmp/expected-{uuid.uuid4().hex[:12]}"


def test_a_put_before_the_bind_and_one_after_land_in_the_one_record_the_endpoint_adopts() -> None:
    endpoint, alias = _endpoint(), _endpoint()
    until = time.monotonic() + 30
    early = expect(endpoint, ("0", "1", "a"), until, unbound=True)
    assert early is not None
    woken: list[int] = []
    own = ExpectedPuts(lambda: woken.append(1))
    record = adopt([alias, endpoint], own, _SHARED)
    assert record is early  # adopted, not copied: the put before the bind is in it
    assert record.wake is own.wake
    # A put between the registration and its publication as served (under either name) lands in it too.
    assert expect(alias, ("0", "1", "b"), until, unbound=True) is record
    assert list(record.slots) == [("0", "1", "a"), ("0", "1", "b")]
    assert record.until(("0", "1", "a")) == until
    settle(endpoint, ("0", "1", "a"))  # its put failed: no longer expected, and waiting gets wake
    assert woken == [1] and list(record.slots) == [("0", "1", "b")]
    release([alias, endpoint], record)
    assert not record.slots and record.wake is None
    assert expect(endpoint, ("0", "1", "c"), until, unbound=False) is None  # nobody binds it now
    fresh = expect(endpoint, ("0", "1", "c"), until, unbound=True)
    assert fresh is not None and fresh is not record


def test_two_names_of_one_endpoint_each_with_puts_before_the_bind_become_one_record() -> None:
    first, second = _endpoint(), _endpoint()
    until = time.monotonic() + 30
    a = expect(first, ("0", "1", "a"), until, unbound=True)
    b = expect(second, ("0", "1", "b"), until, unbound=True)
    assert a is not None and b is not None and a is not b
    record = adopt([first, second], ExpectedPuts(), _SHARED)
    assert set(record.slots) == {("0", "1", "a"), ("0", "1", "b")}
    assert expect(second, ("0", "1", "c"), until, unbound=True) is record
    release([first, second], record)


def test_what_is_not_kept_an_ended_wait_an_unbound_endpoint_and_a_cancelled_key() -> None:
    endpoint = _endpoint()
    now = time.monotonic()
    assert expect(endpoint, ("0", "1", "over"), now - 1, unbound=True) is None
    assert expect(endpoint, ("0", "1", "k"), now + 30, unbound=False) is None
    record = expect(endpoint, ("0", "1", "req1"), now + 30, unbound=True)
    assert record is not None
    # A cleanup before the bind: the expected put it matches goes, and a later put under it is not kept.
    bound = cancel_early(lambda k: k.startswith("req"), [endpoint], key=None, prefix="req", ttl_s=30)
    assert bound == [] and not record.slots
    assert expect(endpoint, ("0", "1", "req2"), now + 30, unbound=True) is None
    assert record.until(("0", "1", "req1")) is None
    release([endpoint], record)


def test_an_expectation_whose_wait_ended_is_not_waited_for() -> None:
    endpoint = _endpoint()
    record = expect(endpoint, ("0", "1", "k"), time.monotonic() + 0.05, unbound=True)
    assert record is not None
    time.sleep(0.1)
    assert record.until(("0", "1", "k")) is None and not record.slots
    release([endpoint], record)


def test_expectations_end_at_their_deadline_at_a_settle_or_at_cleanup() -> None:
    endpoint = _endpoint()
    now = time.monotonic()
    record = expect(endpoint, ("0", "1", "a"), now + 60, unbound=True)
    assert record is not None
    assert expect(endpoint, ("0", "1", "rid_0_1"), now + 60, unbound=True) is record
    assert record.until(("0", "1", "past")) is None  # never expected: nothing to wait for
    assert record.until(("0", "1", "a")) == now + 60
    assert expect(endpoint, ("0", "1", "b"), now + 60, unbound=True) is record
    assert list(record.slots) == [("0", "1", "a"), ("0", "1", "rid_0_1"), ("0", "1", "b")]
    record.settle(("0", "1", "a"))
    assert record.settle_where(lambda key: key.startswith("rid_")) == ["rid_0_1"]
    assert list(record.slots) == [("0", "1", "b")]
    release([endpoint], record)


def test_a_name_another_bound_endpoint_holds_stays_its() -> None:
    name, other = _endpoint(), _endpoint()
    first_shared, second_shared = cast(Any, SimpleNamespace(part=None)), cast(Any, SimpleNamespace(part=None))
    first = adopt([name], ExpectedPuts(), first_shared)
    second = adopt([name, other], ExpectedPuts(), second_shared)
    assert first is not second and first.bound is first_shared and second.bound is second_shared
    assert expect(name, ("0", "1", "k"), time.monotonic() + 30, unbound=False) is first
    assert expect(other, ("0", "1", "k"), time.monotonic() + 30, unbound=False) is second
    release([name, other], second)
    assert expect(name, ("0", "1", "j"), time.monotonic() + 30, unbound=False) is first
    release([name], first)

"""The pull server's long-poll lot, driven directly (no sockets): fair per peer, bounded in count and bytes."""

from __future__ import annotations

from zmq_omni.transport._pull_lot import ENTRY_OVERHEAD, ParkingLot


def _park(lot: ParkingLot, peer: bytes, req: int, key: str = "k", expiry: float = 100.0, size: int = 0) -> tuple:
    return lot.park(peer, req, ("0", "1", key), expiry, None, size)


def test_one_peer_fills_the_lot_and_gives_way_to_another() -> None:
    lot = ParkingLot(max_count=4, max_bytes=1 << 20)
    for i in range(4):
        assert _park(lot, b"hog", i, f"k{i}") == (True, [])
    parked, evicted = _park(lot, b"hog", 9, "k9")  # the hog holds the most: its own FETCH is refused
    assert not parked and evicted == []
    parked, evicted = _park(lot, b"real", 1, "mine")
    assert parked and [e.req_id for e in evicted] == [0]  # the hog's oldest made room
    assert lot.count == 4 and lot.held_by(b"hog") == 3 and lot.held_by(b"real") == 1


def test_bytes_are_bounded_and_the_heaviest_peer_gives_way() -> None:
    weight = 1000 + ENTRY_OVERHEAD
    lot = ParkingLot(max_count=1000, max_bytes=3 * weight)
    for i in range(3):
        assert _park(lot, b"hog", i, f"k{i}", size=1000)[0]
    assert not _park(lot, b"hog", 3, "k3", size=1000)[0]
    parked, evicted = _park(lot, b"real", 1, "mine", size=10)
    assert parked and len(evicted) == 1 and lot.nbytes <= lot.max_bytes
    assert not _park(lot, b"any", 1, "x", size=4 * weight)[0]  # alone larger than the lot


def test_pop_serves_first_come_and_expire_answers_the_rest() -> None:
    lot = ParkingLot(max_count=10, max_bytes=1 << 20)
    _park(lot, b"a", 1, "k", expiry=5.0)
    _park(lot, b"b", 2, "k", expiry=50.0)
    _park(lot, b"c", 3, "other", expiry=6.0)
    served = lot.pop(("0", "1", "k"), now=10.0)  # a's wait ended: b is served, a waits for expire
    assert served is not None and served.identity == b"b"
    assert sorted(e.req_id for e in lot.expire(10.0)) == [1, 3]
    assert lot.count == 0 and lot.nbytes == 0 and ("0", "1", "k") not in lot


def test_a_gone_peer_is_dropped_and_clear_empties() -> None:
    lot = ParkingLot(max_count=10, max_bytes=1 << 20)
    for i in range(3):
        _park(lot, b"gone", i, f"k{i}")
    _park(lot, b"here", 9, "k0")
    assert lot.drop_peer(b"gone") == 3 and lot.peers() == [b"here"]
    assert lot.expire(1000.0)[0].req_id == 9
    _park(lot, b"here", 10)
    assert [e.req_id for e in lot.clear()] == [10] and lot.count == 0


def test_churn_keeps_the_heaps_bounded() -> None:
    lot = ParkingLot(max_count=100, max_bytes=1 << 30)
    for i in range(20_000):
        _park(lot, bytes([i % 7]), i, f"k{i}", expiry=float(i))
        if i % 3 == 0:
            lot.expire(float(i - 50))
    assert len(lot._heaviest) <= 2 * len(lot.peers()) + 64 + 1
    assert len(lot._expiries) <= 2 * lot.count + 64 + 50

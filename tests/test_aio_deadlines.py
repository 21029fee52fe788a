"""``zmq_omni.aio``'s deadlines: one loop timer for every waiting get, on a real event loop."""

from __future__ import annotations

import asyncio
import gc
import weakref

from zmq_omni.aio._expiry import Deadlines


class Item:
    def __init__(self, name: str) -> None:
        self.name = name


def test_due_items_are_called_in_deadline_order_and_discarded_ones_never() -> None:
    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        fired: list[str] = []
        deadlines: Deadlines[Item] = Deadlines(lambda item: fired.append(item.name))
        now = loop.time()
        deadlines.add(loop, now + 0.06, Item("late"))
        gone = deadlines.add(loop, now + 0.02, Item("discarded"))
        deadlines.add(loop, now + 0.04, Item("middle"))
        deadlines.add(loop, now + 0.01, Item("first"))  # earlier than the armed timer: re-armed
        deadlines.discard(gone)
        deadlines.discard(gone)  # idempotent
        await asyncio.sleep(0.3)
        deadlines.close()
        return fired

    assert asyncio.run(main()) == ["first", "middle", "late"]


def test_ended_calls_are_swept_and_their_items_released() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        deadlines: Deadlines[Item] = Deadlines(lambda item: None)
        kept = [deadlines.add(loop, loop.time() + 3600, Item(f"kept{i}")) for i in range(10)]
        refs = []
        for i in range(10_000):
            item = Item(f"ended{i}")
            refs.append(weakref.ref(item))
            deadlines.discard(deadlines.add(loop, loop.time() + 3600, item))
            del item
        gc.collect()
        assert all(ref() is None for ref in refs)  # an ended call's item is not held until its deadline
        assert len(deadlines._heap) <= 2 * len(kept) + 64 + 1
        deadlines.close()

    asyncio.run(main())


def test_close_cancels_what_is_pending() -> None:
    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        fired: list[str] = []
        deadlines: Deadlines[Item] = Deadlines(lambda item: fired.append(item.name))
        entry = deadlines.add(loop, loop.time() + 0.01, Item("never"))
        deadlines.close()
        deadlines.discard(entry)  # after close: a no-op
        await asyncio.sleep(0.1)
        return fired

    assert asyncio.run(main()) == []

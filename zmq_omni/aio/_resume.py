"""Futures whose resolver may resume the awaiting task at once, instead of on the loop's next turn.

``Future.set_result`` never runs the awaiting task: it queues the task's wake-up
with ``call_soon``, and the task runs on the loop's next iteration (one more
``select`` and one more pass of the loop's ready queue; on the default asyncio
loop, written in Python, that is several microseconds a lone message pays on
each hop). When the loop's pump has just read an item for a waiting get, its
callback is the only code running on the loop, and the item's task may as well
run now: :class:`ResumingFuture` lets it.

How it is used (by :class:`~zmq_omni.aio.AsyncConnector`, on the loop's thread):

* ``hold(result)`` resolves the future (``done()`` is true, cancelling it fails,
  as after ``set_result``) but keeps the awaiting task's wake-up;
* the callback that held it, once its own bookkeeping is over and its state
  consistent (no lock held, nothing half-done), calls :func:`resume` on what it
  held: each task runs its next step there, in the order held.

Everything else behaves as a plain future: ``set_result``, ``set_exception`` and
``cancel`` queue the wake-ups with ``call_soon``. :func:`resume` queues them that
way too when a task is already running on the loop (a task cannot be entered
inside another), and when a resumed step raises out (``KeyboardInterrupt``) the
ones not resumed yet are queued, never dropped.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

__all__ = ["ResumingFuture", "queue", "resume"]

T = TypeVar("T")


class ResumingFuture(asyncio.Future[T]):
    """An ``asyncio.Future`` that keeps its callbacks, so that :func:`resume` can run them at once."""

    # The callbacks added while pending. The C future would queue them itself on set_result; kept
    # here, the one who resolved the future decides when they run (see the module docstring).
    __slots__ = ("_waiting",)

    def __init__(self, *, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop=loop)
        self._waiting: list[tuple[Callable[[ResumingFuture[T]], object], contextvars.Context | None]] = []

    def add_done_callback(
        self, fn: Callable[[ResumingFuture[T]], object], *, context: contextvars.Context | None = None
    ) -> None:
        """As ``Future.add_done_callback``: a callback added while pending waits for the result."""
        if self.done():
            super().add_done_callback(fn, context=context)
        else:
            self._waiting.append((fn, context))

    def remove_done_callback(self, fn: Callable[[ResumingFuture[T]], object]) -> int:
        """As ``Future.remove_done_callback``: how many instances of ``fn`` were removed."""
        kept = [entry for entry in self._waiting if entry[0] != fn]
        removed = len(self._waiting) - len(kept)
        self._waiting = kept
        return removed + super().remove_done_callback(fn)

    def set_result(self, result: T) -> None:
        """As ``Future.set_result``: the callbacks run on the loop's next turn."""
        super().set_result(result)
        self._queue_waiting()

    def set_exception(self, exception: type[BaseException] | BaseException) -> None:
        """As ``Future.set_exception``: the callbacks run on the loop's next turn."""
        super().set_exception(exception)
        self._queue_waiting()

    def cancel(self, msg: Any | None = None) -> bool:
        """As ``Future.cancel``: the callbacks run on the loop's next turn."""
        if not super().cancel(msg):
            return False
        self._queue_waiting()
        return True

    def hold(self, result: T) -> None:
        """Resolve with ``result``, keeping the callbacks for :func:`resume` (which must follow)."""
        super().set_result(result)

    def _queue_waiting(self) -> None:
        waiting, self._waiting = self._waiting, []
        loop = self.get_loop()
        for fn, context in waiting:
            loop.call_soon(fn, self, context=context)

    def _run_waiting(self) -> None:
        waiting, self._waiting = self._waiting, []
        for i, (fn, context) in enumerate(waiting):
            try:
                if context is None:
                    fn(self)
                else:
                    context.run(fn, self)
            except BaseException:
                self._waiting = waiting[i + 1 :]
                self._queue_waiting()
                raise


def resume(held: Iterable[ResumingFuture[Any]], loop: asyncio.AbstractEventLoop) -> None:
    """Run the callbacks of the ``held`` futures now, in order: their awaiting tasks take their next step.

    Call from a loop callback, not from a task: when a task is running on ``loop``
    (none can be entered inside another), the callbacks are queued instead.
    """
    futures = list(held)
    if asyncio.current_task(loop) is not None:
        queue(futures)
        return
    for i, future in enumerate(futures):
        try:
            future._run_waiting()
        except BaseException:
            queue(futures[i + 1 :])
            raise


def queue(held: Iterable[ResumingFuture[Any]]) -> None:
    """Queue the callbacks of the ``held`` futures for the loop's next turn, as ``set_result`` would have."""
    for future in held:
        future._queue_waiting()

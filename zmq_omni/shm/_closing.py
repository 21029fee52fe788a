"""The close path the slot pool and the slot reader share: ``with`` closes, an unclosed one warns."""

from __future__ import annotations

import contextlib
import warnings
from typing import TypeVar

# A TypeVar rather than typing.Self, which Python 3.10 lacks.
_ClosingT = TypeVar("_ClosingT", bound="_Closing")


class _Closing:
    """What the pool and the reader share: ``with`` closes, and an unclosed one warns when collected."""

    _closed: bool
    directory: str

    def close(self) -> None:  # pragma: no cover - both subclasses define it
        raise NotImplementedError

    def __enter__(self: _ClosingT) -> _ClosingT:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_closed", True):  # also after a constructor that raised
            return
        warnings.warn(f"unclosed {type(self).__name__} in {self.directory}", ResourceWarning, stacklevel=2, source=self)
        with contextlib.suppress(Exception):
            self.close()

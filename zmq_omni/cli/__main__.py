"""``python -m zmq_omni.cli``: the same as the ``zmq-omni`` console script."""

from __future__ import annotations

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())

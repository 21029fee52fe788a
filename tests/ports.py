"""Loopback TCP ports for tests whose servers run in other processes (and so cannot bind port 0 and tell us).

A port that is merely bound and released is free for anyone until our process
binds it: another test, another checkout's suite on the same machine, or the
source port of any outgoing connection. :func:`reserve_port` is the library's own
helper (``zmq-omni demo --transport tcp`` has the same problem): it leaves the
port in TIME_WAIT, so for the next minute the kernel gives it to no
``bind(port 0)`` and no ``connect``, while a listener with SO_REUSEADDR, as
ZeroMQ's and Python's http.server's are, can still bind it. In-process tests
bind port 0 and read the port back instead.
"""

from __future__ import annotations

from zmq_omni.transport import reserve_loopback_port


def reserve_port() -> int:
    """A loopback TCP port no one else will be handed for about a minute."""
    return reserve_loopback_port()

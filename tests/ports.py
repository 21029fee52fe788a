"""Loopback TCP ports for tests whose servers run in other processes (and so cannot bind port 0 and tell us).

A port that is merely bound and released is free for anyone until our process
binds it: another test, another checkout's suite on the same machine, or the
source port of any outgoing connection. :func:`reserve_port` leaves the port in
TIME_WAIT instead (the accepted side of a connection closes first), so for the
next minute the kernel gives it to no ``bind(port 0)`` and no ``connect``, while
a listener with SO_REUSEADDR, as ZeroMQ's and Python's http.server's are, can
still bind it. In-process tests bind port 0 and read the port back instead.
"""

from __future__ import annotations

import socket


def reserve_port() -> int:
    """A loopback TCP port no one else will be handed for about a minute."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port: int = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):
            accepted, _ = listener.accept()
            accepted.close()
        return port

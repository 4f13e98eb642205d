"""Serving the app with uvicorn: on the command line (`serve`), or in a thread (`running`).

The socket is bound before uvicorn starts, so a port in use is a clear error, port 0 picks
a free one, and the address printed is the one really bound. uvicorn stops cleanly on
Ctrl-C (SIGINT) or SIGTERM: it finishes the requests in flight, then `serve` returns. The
process that serves fixes glibc's mmap threshold (`long_texts.bound_allocator`), so that
its memory after each long text is what it was after the first.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from qkv.serve.long_texts import bound_allocator

LOOPBACK = "127.0.0.1"


def bind(host: str = LOOPBACK, port: int = 8000) -> socket.socket:
    """A listening TCP socket on (host, port); ValueError saying why when it cannot be."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} is out of range: 0-65535 (0 picks a free one)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise ValueError(f"cannot bind to {host!r}: {error.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError as error:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    return sock


def address(sock: socket.socket) -> str:
    """The http:// address a listening socket answers on."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _server(app, quiet: bool):
    level = "warning" if quiet else "info"
    config = uvicorn.Config(app, log_level=level, timeout_graceful_shutdown=5)
    return uvicorn.Server(config)


def serve(app, sock: socket.socket, *, quiet: bool = False) -> None:
    """Serve `app` on a bound socket until Ctrl-C or SIGTERM (from the main thread)."""
    bound_allocator()  # this process is the server's: its memory after each long text is flat
    try:
        _server(app, quiet).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn stops cleanly, then raises Ctrl-C again for us
        pass
    finally:
        sock.close()


@contextmanager
def running(app, host: str = LOOPBACK, port: int = 0) -> Iterator[str]:
    """Serve `app` from a background thread; yield its address; stop it on leaving.

    For tests and benchmarks that need a real HTTP server in the same process (whose
    allocator it sets as `serve` does: `qkv.serve.long_texts.bound_allocator`).
    """
    bound_allocator()
    sock = bind(host, port)
    server = _server(app, quiet=True)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        for _ in range(1000):  # started: at most 10 s, polled every 10 ms
            if server.started or not thread.is_alive():
                break
            threading.Event().wait(0.01)
        if not server.started:
            raise RuntimeError("the server did not start")
        yield address(sock)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()

"""A TCP proxy that counts round trips: a client's send that follows a server's answer starts
a new one. Put it between a store and its database to see what one operation costs on the
wire (tests/test_sql_stores.py), whatever the driver does underneath."""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any


class TurnsProxy:
    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.turns = 0
        self._answered: dict[int, bool] = {}
        self._mutex = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._answered[id(client)] = True
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        conn = id(src if upstream else dst)
        try:
            while data := src.recv(65536):
                with self._mutex:
                    if upstream and self._answered[conn]:
                        self.turns += 1
                    self._answered[conn] = not upstream
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def count(self, call: Any) -> int:
        """The round trips ``call()`` makes (any connection through this proxy)."""
        before = self.turns
        call()
        return self.turns - before

    def close(self) -> None:
        self.listener.close()

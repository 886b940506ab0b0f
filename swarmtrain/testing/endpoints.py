"""An endpoint that only counts who connects to it: what a test gives an outsider to prove nobody dials it."""

from __future__ import annotations

import socket
import threading

__all__ = ["DialCounter"]


class DialCounter:
    """Listens on 127.0.0.1 (port 0) in a thread; `count` is how many connections arrived. `close()` it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="dial-counter", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.count += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()

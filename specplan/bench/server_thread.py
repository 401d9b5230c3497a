"""A FastAPI app (specplan's server) under uvicorn in a background thread, on a free loopback
port: how a sweep serves its engine in-process."""

from __future__ import annotations

import threading
import time
from typing import Any


class ServerThread:
    """A FastAPI app under uvicorn on 127.0.0.1 (a free port), in a background thread."""

    def __init__(self, app: Any):
        import socket

        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                                    timeout_graceful_shutdown=10))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="specplan-sweep-server", daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the sweep's server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until the engine has nothing running or waiting (cancelled requests are being cleaned up)."""
        import httpx

        deadline = time.monotonic() + timeout
        with httpx.Client(trust_env=False, timeout=10) as client:
            while time.monotonic() < deadline:
                try:
                    s = client.get(self.url + "/debug/engine").json()
                    if s.get("running", 0) == 0 and s.get("waiting", 0) == 0 and s.get("active_jobs", 0) == 0:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)


__all__ = ["ServerThread"]

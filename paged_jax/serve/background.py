"""A server in this process on a free loopback port (uvicorn on a thread): for tests, notebooks
and experiments that send real HTTP requests to an app they built (serve/api.build_app)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn


class Server:
    """`with Server(app) as srv:` serves `app` at srv.url until the block ends."""

    def __init__(self, app):
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs=dict(sockets=[self.sock]),
                                       daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()
        if self.thread.is_alive():
            raise RuntimeError("the server did not shut down within 30 s")

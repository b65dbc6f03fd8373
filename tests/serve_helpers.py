"""A server on a free loopback port, in this process (uvicorn on a thread), for tests."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from paged_jax.llm import LLM
from paged_jax.serve.api import build_app
from tests.engine_helpers import model

MODEL = "tiny"
ENGINE = dict(block_size=8, num_kv_blocks=160, max_num_seqs=8, max_num_batched_tokens=64,
              max_model_len=256, decode_window=4, static_shapes=True)


def tiny_llm(**overrides) -> LLM:
    return LLM(model_parts=model(), **{**ENGINE, **overrides})


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
                raise RuntimeError("the test server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()
        assert not self.thread.is_alive(), "the server did not shut down"


def serve(max_pending: int = 256, **overrides) -> Server:
    return Server(build_app(tiny_llm(**overrides), MODEL, max_pending))


def metric(text: str, name: str, **labels) -> float:
    """The value of one sample of Prometheus text (0 if absent)."""
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            rest = line[len(name):]
            if rest[:1] in (" ", "{"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0

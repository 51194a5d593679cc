"""Model, engine, loop and app in one call, and a uvicorn server on 127.0.0.1 that a test (or the
smoke script) can start on a free port in a thread and stop again."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import uvicorn

from harness.text_tokenizer import load_tokenizer
from l1_contiguous import InputError
from l5_eviction import engine_backend, load_engine_model

from .app import ServerConfig, create_app
from .engine import make_serve_engine
from .loop import EngineLoop


def build_server(model_dir: str | Path, num_blocks: int = 512, block_size: int = 16, device: str = "cpu",
                 dtype=None, max_waiting: int | None = None, prefix_sharing: bool = True, **engine_kwargs):
    """(app, loop, tokenizer) serving `model_dir`; InputError for a folder or pool that cannot work.
    max_waiting None: `default_max_waiting(num_blocks)`. The tokenizer is harness.text_tokenizer's,
    not transformers' AutoTokenizer (which answers the same): the grader runs this server in a
    worker whose environment has no transformers, the oracle the tests compare against."""
    import torch

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise InputError(f"{model_dir} has no config.json; pass --model with an HF-format model folder")
    model = load_engine_model(model_dir, dtype or torch.float32, device)
    engine = make_serve_engine(model, num_blocks, block_size, prefix_sharing=prefix_sharing,
                               backend=engine_backend(device, model.dtype), **engine_kwargs)
    tokenizer = load_tokenizer(model_dir)
    loop = EngineLoop(engine)
    max_waiting = default_max_waiting(num_blocks) if max_waiting is None else max_waiting
    app = create_app(loop, tokenizer, ServerConfig(model_name=model_dir.name, max_waiting=max_waiting))
    return app, loop, tokenizer


def default_max_waiting(num_blocks: int) -> int:
    """How many requests may wait for a first token before the next gets 429: four per block of
    the pool, at least 64. A waiting request holds no KV block, only its prompt ids and a few
    objects (a few KB), so the bound is about what the pool can work through soon, not memory:
    a load generator that opens 512 connections (guidellm's default sweep) is queued, not refused,
    on the default 512-block pool."""
    return max(64, 4 * num_blocks)


class GracefulServer(uvicorn.Server):
    """uvicorn's server; on SIGINT/SIGTERM the engine loop first aborts what is in flight, so every open
    stream ends with finish_reason "abort" and [DONE] instead of being cut when uvicorn's grace runs out."""

    def __init__(self, config: uvicorn.Config, loop: EngineLoop):
        super().__init__(config)
        self.engine_loop = loop

    def handle_exit(self, sig, frame) -> None:
        self.engine_loop.request_stop()
        super().handle_exit(sig, frame)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """uvicorn in a background thread: `with Server(app) as url:` ... stopped (and joined) on exit."""

    def __init__(self, app, port: int | None = None, start_timeout: float = 30.0):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                timeout_graceful_shutdown=3)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.start_timeout = start_timeout

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)

"""`python -m l11_serve`: serve a model folder (default: the embedded one) on 127.0.0.1."""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import traceback

from harness.cli import exit_interrupted, interrupt_received, sane_streams, say_error, starting, watch_interrupts

with starting():  # Ctrl-C while torch and the model's code load: one line, exit 2
    import uvicorn

    from harness.smoke import DEFAULT_MODEL, resolve_device
    from l1_contiguous import InputError

    from .server import GracefulServer, build_server


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m l11_serve", description=__doc__)
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="HF-format model folder (default: the embedded one)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--num-blocks", type=int, default=512, help="KV pool size in blocks (default 512)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-waiting", type=int, default=None,
                   help="requests without a first token before new ones get 429 (default: 4 per pool block, at least 64)")
    p.add_argument("--prefix-sharing", choices=["on", "off"], default="on")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    args = p.parse_args(argv)
    sane_streams()
    watch_interrupts()
    try:
        if (args.max_waiting is not None and args.max_waiting < 1) or args.block_size < 1:
            raise InputError("--max-waiting and --block-size must be at least 1")
        if not 0 <= args.port <= 65535:
            raise InputError(f"--port {args.port} is not a TCP port; give 1..65535 (or 0 for any free one)")
        args.port = check_port_free(args.host, args.port)
        device, dtype = resolve_device(args.device, args.dtype)
        app, loop, _ = build_server(args.model, args.num_blocks, args.block_size, device, dtype, args.max_waiting,
                                 prefix_sharing=args.prefix_sharing == "on")
    except KeyboardInterrupt:
        exit_interrupted("interrupted (Ctrl-C) while building the server; nothing was served")
    except Exception as exc:
        if interrupt_received():  # C code turned the Ctrl-C into an error of its own
            exit_interrupted("interrupted (Ctrl-C) while building the server; nothing was served")
        if isinstance(exc, InputError):
            say_error(str(exc))
            return 2
        traceback.print_exc()
        print("internal error while building the server (a bug, not your input)", file=sys.stderr)
        return 3
    logging.basicConfig(level=logging.INFO)
    print(f"serving {args.model} on http://{args.host}:{args.port} (pool page at /, Ctrl-C stops)", flush=True)
    # SIGINT/SIGTERM: the engine loop aborts what is in flight (each stream ends with "abort" and [DONE]),
    # uvicorn stops accepting, waits for the connections to close, ends the app's lifespan and exits.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=5)
    # uvicorn raises the signal again once it has shut down; these make that a plain exit 0.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        GracefulServer(config, loop).run()
    except KeyboardInterrupt:
        pass
    return 0


def check_port_free(host: str, port: int) -> int:
    """The port to serve on: `port` if it can be bound, a free one chosen now for port 0."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            raise InputError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); pick another --port") from None
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())

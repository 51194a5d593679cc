"""L11: L8's engine behind an OpenAI-compatible streaming server, with metrics and a live pool page.

The names below are imported on first use (PEP 562), so that `python -m l11_serve` can guard its
own start (Ctrl-C while torch loads: one line, exit 2) before anything heavy is imported.
"""

import importlib

_EXPORTS = {
    "ServerConfig": "app", "create_app": "app",
    "ServeEngine": "engine", "ServeItem": "engine", "ServeRequest": "engine", "make_serve_engine": "engine",
    "nucleus": "engine", "truncated": "engine",
    "EngineLoop": "loop", "Stream": "loop", "Update": "loop",
    "ServeMetrics": "metrics",
    "CompletionParams": "protocol", "parse_completion": "protocol",
    "Server": "server", "build_server": "server",
    "StopMatcher": "stops",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'l11_serve' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *_EXPORTS])

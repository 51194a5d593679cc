"""L11: L8's engine behind an OpenAI-compatible streaming server, with metrics and a live pool page."""

from .app import ServerConfig, create_app
from .engine import ServeEngine, ServeItem, ServeRequest, make_serve_engine, nucleus
from .loop import EngineLoop, Stream, Update
from .metrics import ServeMetrics
from .protocol import CompletionParams, parse_completion
from .server import Server, build_server
from .stops import StopMatcher

__all__ = [
    "ServerConfig", "create_app", "ServeEngine", "ServeItem", "ServeRequest", "make_serve_engine", "nucleus",
    "EngineLoop", "Stream", "Update", "ServeMetrics", "CompletionParams", "parse_completion", "Server",
    "build_server", "StopMatcher",
]

"""``conveyor serve gradio``: a web chat on the engine in this process or on a running api_server."""

from .app import create_app, serve_webchat
from .backends import ApiServerBackend, ChatBackend, Piece, PipelineBackend

__all__ = ["ApiServerBackend", "ChatBackend", "Piece", "PipelineBackend", "create_app", "serve_webchat"]

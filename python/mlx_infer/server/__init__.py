"""OpenAI-compatible HTTP server over :class:`mlx_infer.engine.Engine` (needs the ``server`` extra)."""

from .app import create_app
from .run import DEFAULT_HOST, DEFAULT_PORT, ServeOptions, ServerThread, build, serve

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "ServeOptions", "ServerThread", "build", "create_app", "serve"]

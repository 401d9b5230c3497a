"""The OpenAI-compatible HTTP server: request schemas (protocol.py), the engine loop thread that
owns the engine (loop.py), Prometheus metrics (metrics.py) and the FastAPI app (app.py).

Importing this package imports fastapi; ``specplan.engine`` alone does not."""

from .app import build_engine, create_app, serve

__all__ = ["build_engine", "create_app", "serve"]

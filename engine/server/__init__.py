"""The OpenAI-compatible HTTP server: request schemas (protocol.py), the engine loop thread that
owns the engine (loop.py), Prometheus metrics (metrics.py) and the FastAPI app (app.py)."""

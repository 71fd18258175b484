"""The HTTP ingress: the OpenAI-compatible app (app.py), its schemas, SSE and metrics, and the process (process.py)."""

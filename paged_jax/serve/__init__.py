"""An OpenAI-compatible server over the engine: async_engine.py (the engine on its own
thread), api.py (FastAPI routes), protocol.py / sse.py (OpenAI bodies and streams), fields.py
/ messages.py (each request field's type, chat messages: a malformed one is a 400 naming it),
metrics.py (Prometheus, vLLM's names), cli.py (`python -m paged_jax.serve`)."""

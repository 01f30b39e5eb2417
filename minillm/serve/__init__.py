"""minillm behind an HTTP server: the async engine loop (async_engine.py); the OpenAI-compatible server, metrics and
the live page build on it."""

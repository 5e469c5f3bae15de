"""Entry points that serve the engine to other programs (the OpenAI-compatible HTTP server)."""

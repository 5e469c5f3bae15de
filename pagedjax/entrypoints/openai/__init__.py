"""`pagedjax serve`: an OpenAI-compatible HTTP server over `AsyncLLM`, as vLLM's.

protocol.py holds the request and response shapes, serving_*.py turn requests into engine
calls and responses, metrics.py the Prometheus metrics, api_server.py the app and its routes.
"""

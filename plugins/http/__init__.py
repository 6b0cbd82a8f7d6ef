"""Serving: continuous batching over any backend (scheduler.py), the OpenAI-compatible HTTP API
(api.py, app.py), text in and out (text.py) and the `mqa-serve` command (cli.py)."""

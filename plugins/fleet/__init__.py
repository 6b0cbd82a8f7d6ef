"""Deployment: several `mqa-serve` replicas behind vLLM's router, started by `mqa-fleet` (cli.py)."""

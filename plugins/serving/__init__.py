"""Serving state that outlives one call: the KV pool of a continuous batch, the prefix cache, and
the scheduler that admits requests into it (used by the HTTP server and the serving benchmark)."""

"""The engine contract (what callers may ask of an engine), the registry of engines by name, and
what engines share: sampling, the generate loop, speculative decoding, the single-head KV cache."""

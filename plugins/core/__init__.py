"""Foundations every layer stands on: paths, model configs, HF checkpoint I/O (seeded init, the one
safetensors reader), atomic writes, the tokenizer and prompts, and tensor facts (dtypes, input
checks, KV byte math). Nothing here knows an engine."""

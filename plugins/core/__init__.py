"""What every engine and tool shares: the Backend protocol and its checks, dtypes, model configs,
HF checkpoint I/O (seeded init, the one safetensors reader), the tokenizer and prompts, the
generation loop and sampler, speculative decoding, and the launcher for tensor-parallel ranks."""

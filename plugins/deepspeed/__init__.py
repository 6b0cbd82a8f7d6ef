"""The DeepSpeed engines behind the Backend protocol: kernel injection with our gpt_bigcode policy
(`DeepSpeedBackend`, the `injection/` package) and DeepSpeed AutoTP with balanced MQA shards, StarCoder2's
KV heads split over the ranks (`AutoTPBackend`)."""

from plugins.deepspeed.backend import AutoTPBackend, DeepSpeedBackend

__all__ = ["AutoTPBackend", "DeepSpeedBackend"]

"""The DeepSpeed engines behind the Backend protocol: kernel injection with our gpt_bigcode policy
(`DeepSpeedBackend`, the `injection/` package) and DeepSpeed AutoTP with balanced MQA shards
(`AutoTPBackend`)."""

from plugins.deepspeed.backend import AutoTPBackend, DeepSpeedBackend

__all__ = ["AutoTPBackend", "DeepSpeedBackend"]

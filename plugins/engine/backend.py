"""What every in-process engine shares (HF, DeepSpeed, Megatron): inputs checked before any compute,
the generate loop on the engine's own `decoder`, the option check against `from_hf`'s signature,
and the defaults of the optional contract methods."""

from __future__ import annotations

import inspect

from transformers import GPTBigCodeConfig

from plugins.core.config import ConfigError
from plugins.core.tensors import check_inputs
from plugins.engine.contract import GenerationResult
from plugins.engine.generation import generate
from plugins.engine.sampling import Sampler


class LocalBackend:
    """What every in-process backend shares: inputs checked before any compute, then moved to its device."""

    name: str
    config: GPTBigCodeConfig
    device: str
    kv_layout = "head"  # KV cache over TP ranks: "head" (heads split, MQA's one head copied) or "batch"
    runs_elsewhere = False  # its ranks are other processes (plugins.launch): a model runner opens on each
    speculative: dict | None = None  # speculative decoding's checked options (deepspeed) ...
    draft = None                     # ... and the draft model's backend (None: prompt lookup)

    @classmethod
    def from_hf(cls, hf_dir, dtype="float32", tp_size: int = 1):
        """Load an HF checkpoint directory (each engine takes its own options after these)."""
        raise NotImplementedError

    def _prepare(self, input_ids, attention_mask, max_new_tokens=0):
        check_inputs(self.config, input_ids, attention_mask, max_new_tokens)
        return input_ids.to(self.device), attention_mask.to(self.device)

    def decoder(self, batch: int, max_length: int):
        """A `Decoder` (plugins.engine.contract) for `batch` sequences of up to `max_length` cached tokens."""
        raise NotImplementedError

    def generate(self, input_ids, attention_mask, max_new_tokens, do_sample=False, temperature=1.0, top_k=0,
                 top_p=1.0, seed=0) -> GenerationResult:
        input_ids, attention_mask = self._prepare(input_ids, attention_mask, max_new_tokens)
        sampler = Sampler(do_sample, temperature, top_k, top_p, seed)
        # the last new token is sampled, never fed back: T + N - 1 tokens are ever cached
        decoder = self.decoder(input_ids.shape[0], input_ids.shape[1] + max(max_new_tokens - 1, 0))
        result = generate(decoder, input_ids, attention_mask, max_new_tokens, sampler)
        result.tokens = result.tokens.cpu()
        return result

    def close(self) -> None:
        pass

    def dead_worker(self) -> str | None:
        """What died of the processes this backend runs on, if any (in-process: nothing)."""
        return None

    def open_runner(self, slots: int, capacity: int):
        """Only for backends whose ranks run elsewhere: an in-process one's runner opens in this process
        (plugins.serving.runner.open_runner)."""
        raise ConfigError(f"backend {self.name!r} runs in this process: open its runner with "
                          "plugins.serving.runner.open_runner")

    def linear_paths(self, batch: int, prompt_len: int) -> dict:
        """Which implementation runs the linears of a decode step and of the prefill (plugins.kernels);
        engines that call torch directly report 'torch'."""
        return {"decode": "torch", "prefill": "torch"}

    def batch_decoder(self, slots: int, capacity: int):
        """A `BatchDecoder` (plugins.engine.contract) on a KV pool of `slots` x `capacity` tokens."""
        raise ConfigError(f"backend {self.name!r} has no continuous batching")

    @classmethod
    def check_options(cls, config: GPTBigCodeConfig, tp_size: int, **options) -> None:
        """Refuse, before any work, options this backend does not take or cannot apply to `config` at
        `tp_size` (bench configs are checked with this before any checkpoint is made)."""
        known = [p for p in inspect.signature(cls.from_hf).parameters if p not in ("hf_dir", "dtype", "tp_size")]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ConfigError(f"unknown option(s) {', '.join(unknown)} for backend {cls.name!r}; "
                              f"known: {', '.join(known) or 'none'}")

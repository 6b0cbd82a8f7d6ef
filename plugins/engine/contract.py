"""The engine contract: what the comparison, the server and the launcher may call on an engine.

`Backend` is what `load_backend` returns (HF, DeepSpeed, Megatron, peers; a `RemoteBackend` of
worker ranks too). An engine that generates through the shared loop supplies a `Decoder`; one that
serves a continuous batch supplies a `BatchDecoder` (plugins.serving drives it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from transformers import GPTBigCodeConfig


@dataclass
class GenerationResult:
    tokens: torch.Tensor                  # LongTensor [B, T + N]: prompt (as given, padded) + new tokens
    prefill_s: float                      # prompt forward + first token
    step_s: list[float] = field(default_factory=list)  # one entry per further token
    kv_cache_bytes: int = 0               # bytes held by the KV cache tensors (measured, per rank)
    stats: dict = field(default_factory=dict)  # engine-specific figures, e.g. speculative acceptance_rate

    @property
    def new_tokens(self) -> int:
        return len(self.step_s) + 1


@runtime_checkable
class Backend(Protocol):
    name: str
    config: GPTBigCodeConfig
    dtype: torch.dtype
    tp_size: int
    device: str
    kv_layout: str  # "head" (KV heads split over ranks, MQA's one head copied) or "batch" (sequences split)
    runs_elsewhere: bool  # its ranks are worker processes (plugins.launch): `open_runner` opens one on each
    speculative: dict | None  # speculative decoding's options ({"k", "draft", ...}) where loaded with them
    draft: "Backend | None"   # the draft model's backend (None: prompt lookup, or no speculation)

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """FloatTensor [B, T, V] for every position (padded positions included)."""

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                 do_sample: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0) -> GenerationResult:
        """Greedy or seeded sampling on a left-padded batch; no early stop."""

    def close(self) -> None:
        """Release what the backend holds (worker processes for TP > 1)."""

    @classmethod
    def check_options(cls, config: GPTBigCodeConfig, tp_size: int, **options) -> None:
        """Refuse options this backend does not take, before any work."""

    def batch_decoder(self, slots: int, capacity: int) -> "BatchDecoder":
        """The decode step of a continuous batch on a KV pool of `slots` x `capacity` tokens; raises
        ConfigError where the engine cannot batch."""

    def linear_paths(self, batch: int, prompt_len: int) -> dict:
        """Which implementation runs the linears of a decode step and of the prefill."""

    def dead_worker(self) -> str | None:
        """Which of its worker processes died (None while all live, and in-process)."""

    def open_runner(self, slots: int, capacity: int):
        """Where `runs_elsewhere`: a model runner in every rank (plugins.serving.runner.open_runner)."""


class Decoder(Protocol):
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor) -> torch.Tensor:
        """Run the prompt, fill the cache; return logits of the last position [B, V]."""

    def decode(self, tokens: torch.Tensor, attention_mask: torch.Tensor,
               position_ids: torch.Tensor) -> torch.Tensor:
        """One new token per sequence [B, 1] (mask covers cache + token); return logits [B, V]."""

    def kv_cache_bytes(self) -> int:
        """Bytes held by the KV cache tensors."""


class BatchDecoder(Protocol):
    """An engine's decode step on a KV pool (plugins.serving drives it). Pool tensors have the batch row
    on `batch_dim` and the token column on `time_dim`."""

    batch_dim: int
    time_dim: int
    fuses_chunks: bool  # `mixed` runs prompt chunks inside a decode step's forward

    def prefill_alone(self, input_ids: torch.Tensor, prefix: list[torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One unpadded prompt [1, P] -> (logits of its last position [1, V], its K and V per layer: P
        columns, in the order and layout of `pool_tensors`). `prefix`: the K and V of its first columns,
        already computed (a prefix-cache hit): only the rest of the prompt runs."""

    def pool_tensors(self) -> list[torch.Tensor]:
        """Every K and V buffer of the pool (allocated by the first `prefill_alone` at the latest)."""

    def decode(self, tokens: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Rows [0, n) of the pool: tokens [n, 1] written at column t = mask width - 1; logits [n, V]."""

    def verify(self, tokens: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Rows [0, n) with several new tokens each [n, w] (speculative decoding): logits [n, w, V]."""

    def mixed(self, tokens: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
              chunks: list) -> tuple[torch.Tensor, list]:
        """Where `fuses_chunks`: `decode` and prompt chunks ((ids [1, end], prefix K and V or None, as
        `prefill_alone` takes them, or a `kv_cache.SharedPrefix`: the first columns of an earlier chunk of
        this forward) in one forward -> (logits [n, V], [(logits [1, V], K and V)])."""

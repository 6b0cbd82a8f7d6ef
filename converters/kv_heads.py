"""Mean-pooling or repeating the K/V heads of the hub's fused QKV (MHA -> GQA / MQA and back)."""

from __future__ import annotations

import torch
from transformers import GPTBigCodeConfig

from converters.errors import ConversionError
from plugins.core.config import kv_heads

def with_groups(config: GPTBigCodeConfig, groups: int) -> GPTBigCodeConfig:
    """A copy of `config` with `groups` KV heads (MQA, MHA, or Megatron-only GQA)."""
    d = config.to_dict()
    d.pop("num_query_groups", None)
    d["multi_query"] = groups == 1
    d["num_key_value_heads"] = groups  # HF derives it from multi_query, but from_dict would keep the old one
    new = GPTBigCodeConfig.from_dict(d)
    if 1 < groups < config.n_head:
        new.num_query_groups = groups
    return new


def pool_kv_heads(hf_state: dict, config: GPTBigCodeConfig, target: int):
    """Mean-pool adjacent K and V heads into `target` groups (Ainslie et al. 2023, GQA).

    Returns (config, hub state); the queries are untouched. `target` must divide the current
    number of KV heads (MHA -> MQA/GQA, or GQA -> fewer groups).
    """
    g, n = kv_heads(config), config.n_head
    if not isinstance(target, int) or isinstance(target, bool) or target < 1 or g % target or n % target:
        raise ConversionError(f"kv_heads={target!r}: must be a positive divisor of the {g} KV heads "
                              f"of the source (n_head {n})")
    return regroup_kv_heads(hf_state, config, target,
                            lambda kv: kv.reshape(target, g // target, *kv.shape[1:]).float().mean(1).to(kv.dtype))


def regroup_kv_heads(hf_state: dict, config: GPTBigCodeConfig, groups: int, new_kv) -> tuple[GPTBigCodeConfig, dict]:
    """The model with `groups` KV heads: each layer's c_attn regrouped, `new_kv` mapping the source's
    [KV heads, 2 (k, v), d, ...] to [groups, 2, d, ...] (pooled when fewer, repeated when more)."""
    g, n, d = kv_heads(config), config.n_head, config.n_embd // config.n_head
    if groups == g:
        return config, hf_state
    out = dict(hf_state)
    for i in range(config.n_layer):
        for kind in ("weight", "bias"):
            name = f"transformer.h.{i}.attn.c_attn.{kind}"
            t = hf_state[name]
            rest = t.shape[1:]
            grouped = t.reshape(g, n // g + 2, d, *rest)  # per group [q heads | k | v]
            q = grouped[:, : n // g].reshape(groups, n // groups, d, *rest)
            out[name] = torch.cat([q, new_kv(grouped[:, n // g:])], 1).reshape(-1, *rest)
    return with_groups(config, groups), out

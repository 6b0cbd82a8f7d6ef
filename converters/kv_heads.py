"""Mean-pooling or repeating the K/V heads of the hub (MHA -> GQA / MQA and back): gpt_bigcode's fused QKV
`c_attn`, or StarCoder2's `k_proj` / `v_proj`."""

from __future__ import annotations

import torch
from transformers import GPTBigCodeConfig, Starcoder2Config

from converters.errors import ConversionError
from plugins.core.config import arch, kv_heads


def with_groups(config, groups: int):
    """A copy of `config` with `groups` KV heads (MQA, MHA, or GQA: Megatron-only for gpt_bigcode)."""
    d = config.to_dict()
    if arch(config).family == "starcoder2":
        d["num_key_value_heads"] = groups
        return Starcoder2Config.from_dict(d)
    d.pop("num_query_groups", None)
    d["multi_query"] = groups == 1
    d["num_key_value_heads"] = groups  # HF derives it from multi_query, but from_dict would keep the old one
    new = GPTBigCodeConfig.from_dict(d)
    if 1 < groups < config.n_head:
        new.num_query_groups = groups
    return new


def pool_kv_heads(hf_state: dict, config, target: int):
    """Mean-pool adjacent K and V heads into `target` groups (Ainslie et al. 2023, GQA).

    Returns (config, hub state); the queries are untouched. `target` must divide the current
    number of KV heads (MHA -> MQA/GQA, or GQA -> fewer groups).
    """
    g, n = kv_heads(config), arch(config).n_head
    if not isinstance(target, int) or isinstance(target, bool) or target < 1 or g % target or n % target:
        raise ConversionError(f"kv_heads={target!r}: must be a positive divisor of the {g} KV heads "
                              f"of the source (n_head {n})")
    return regroup_kv_heads(hf_state, config, target,
                            lambda kv: kv.reshape(target, g // target, *kv.shape[1:]).float().mean(1).to(kv.dtype))


def layer_kv(hf_state: dict, config, i: int, kind: str) -> torch.Tensor:
    """Layer i's K and V heads ("weight" or "bias") as [KV heads, 2 (k, v), head dim, ...]."""
    a = arch(config)
    g, d = a.kv_heads, a.head_dim
    if a.family == "starcoder2":
        k, v = (hf_state[f"model.layers.{i}.self_attn.{p}_proj.{kind}"] for p in "kv")
        return torch.stack([k.reshape(g, d, *k.shape[1:]), v.reshape(g, d, *v.shape[1:])], 1)
    t = hf_state[f"transformer.h.{i}.attn.c_attn.{kind}"]
    return t.reshape(g, a.n_head // g + 2, d, *t.shape[1:])[:, a.n_head // g:]


def regroup_kv_heads(hf_state: dict, config, groups: int, new_kv) -> tuple:
    """The model with `groups` KV heads: each layer's K and V regrouped, `new_kv` mapping the source's
    [KV heads, 2 (k, v), d, ...] to [groups, 2, d, ...] (pooled when fewer, repeated when more)."""
    a = arch(config)
    g, n, d = a.kv_heads, a.n_head, a.head_dim
    if groups == g:
        return config, hf_state
    out = dict(hf_state)
    for i in range(a.n_layer):
        for kind in ("weight", "bias"):
            kv = new_kv(layer_kv(hf_state, config, i, kind))
            rest = kv.shape[3:]
            if a.family == "starcoder2":
                for j, p in enumerate("kv"):
                    out[f"model.layers.{i}.self_attn.{p}_proj.{kind}"] = kv[:, j].reshape(-1, *rest).contiguous()
                continue
            name = f"transformer.h.{i}.attn.c_attn.{kind}"
            q = hf_state[name].reshape(g, n // g + 2, d, *rest)[:, : n // g].reshape(groups, n // groups, d, *rest)
            out[name] = torch.cat([q, kv], 1).reshape(-1, *rest)
    return with_groups(config, groups), out

"""The one mapping table between HF gpt_bigcode names and Megatron names, and the TP rules.

Every conversion goes through the *hub*: an HF-named full state dict (`lm_head.weight` absent
when tied) plus its `GPTBigCodeConfig`. `TABLE` lists, for each HF tensor, its megatron-core
name, its Megatron-LM legacy name and how it is partitioned over tensor-parallel ranks; splitting
(hub -> rank state dicts) and merging (rank state dicts -> hub) are both derived from it.

`hf_to_mcore` / `mcore_to_hf` are the API the megatron-core adapter (`plugins/megatron`, the
`megatron` checkpoint format) uses: one state dict per TP rank with exactly the names and shapes
of `GPTModel.state_dict()` (local layer spec), without the `_extra_state` keys.

Attention layout. All formats store the fused QKV per query group as `[q heads of the group | k | v]`
(megatron-core `linear_qkv`, Megatron-LM `query_key_value` since checkpoint_version 2). With one
group that is HF's MQA `c_attn` `[Q | K | V]`; with n_head groups it is HF's MHA per-head
`[q_h, k_h, v_h]`; so the hub keeps `c_attn` in that grouped layout for any number of groups and
no reordering is ever needed. GQA (1 < groups < n_head) exists only on the Megatron side: the hub
config then carries `num_query_groups` and `multi_query=False`, and writing it as HF is an error
(HF gpt_bigcode implements only MQA and MHA).

TP rules. Column-parallel tensors split on dim 0, row-parallel weights on dim 1, the rest is
replicated (and must be identical on every rank when merging). Word embeddings and an untied
output layer are padded with zero rows to `padded_vocab_size` before splitting and trimmed after
merging. QKV with fewer groups than ranks: megatron-core splits the fused tensor evenly on dim 0
and all-gathers at run time (`Attention.get_query_key_value_tensors`), so `mcore` does exactly
that; the legacy and BigCode layouts give each rank its own query heads plus a replica of its
group's K and V.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import GPTBigCodeConfig

from converters.errors import ConversionError
from converters.kv_heads import pool_kv_heads, regroup_kv_heads, with_groups  # noqa: F401 (KV pooling: kv_heads.py)
from plugins.core.config import TANH_GELUS, ConfigError, check_tp, head_dim, hf_shapes, kv_heads
from plugins.core.tensors import FLOAT_DTYPES

DIVISIBLE_BY = 128  # Megatron's default --make-vocab-size-divisible-by (multiplied by TP)
MCORE_DIALECTS = ("mcore", "mcore-te")  # megatron-core GPTModel names: local layer spec / Transformer Engine spec
DIALECTS = (*MCORE_DIALECTS, "legacy", "bigcode")
# megatron-core's get_gpt_layer_local_spec() `sharded_state_dict_keys_map`: the local spec's layer norms under
# the names the Transformer Engine spec gives them (fused into the next linear as its layer_norm_weight/bias).
TE_LAYER_NORMS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                  "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def te_name(name: str) -> str:
    """A local-spec megatron-core name -> the Transformer Engine spec's name of the same tensor."""
    for old, new in TE_LAYER_NORMS.items():
        name = name.replace("." + old, "." + new)
    return name


# --------------------------------------------------------------------------- model geometry

def padded_vocab_size(vocab_size: int, tp_size: int = 1, divisible_by: int = DIVISIBLE_BY) -> int:
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def check_megatron_config(config: GPTBigCodeConfig, tp_size: int, dialect: str) -> None:
    """What Megatron formats can express at this TP size, refused before any work."""
    Layout(config, tp_size, None, dialect)
    if config.activation_function not in TANH_GELUS + ("gelu",):
        raise ConversionError(f"activation {config.activation_function!r} has no Megatron equivalent; "
                              f"use one of {', '.join(TANH_GELUS + ('gelu',))}")
    if getattr(config, "add_cross_attention", False):
        raise ConversionError("cross-attention gpt_bigcode models are not supported")


def stored_dtype(hf_state: dict) -> torch.dtype:
    """The dtype a checkpoint's weights are stored in (they share one: converters cast them together)."""
    return next(t.dtype for t in hf_state.values() if t.dtype in FLOAT_DTYPES)


class Layout:
    """A TP layout of one model in one dialect, checked: what the partition rules need to know."""

    def __init__(self, config: GPTBigCodeConfig, tp: int, padded_vocab: int | None, dialect: str):
        if dialect not in DIALECTS:
            raise ConversionError(f"unknown dialect {dialect!r}; known: {', '.join(DIALECTS)}")
        try:
            check_tp(config, tp)
        except ConfigError as e:
            raise ConversionError(str(e)) from None
        self.n_head, self.groups, self.tp, self.dialect = config.n_head, kv_heads(config), tp, dialect
        self.head_dim = head_dim(config)
        self.vocab = config.vocab_size
        self.padded_vocab = padded_vocab or padded_vocab_size(config.vocab_size, tp)
        if self.padded_vocab < self.vocab or self.padded_vocab % tp:
            raise ConversionError(f"padded vocab {self.padded_vocab} must be >= vocab_size {self.vocab} "
                                  f"and divisible by tp_size {tp}")
        if dialect == "bigcode" and self.groups not in (1, self.n_head):
            raise ConversionError("the BigCode Megatron-LM fork stores only multi-query or multi-head attention")
        # BigCode's fork stores MQA attention as two tensors (query, key_value), MHA like legacy.
        self.split_qkv = dialect == "bigcode" and self.groups == 1 and self.n_head > 1


# --------------------------------------------------------------------------- partition rules

def _same(name: str, shards: list[torch.Tensor], ranks: list[int]) -> torch.Tensor:
    for r, t in zip(ranks[1:], shards[1:]):
        if not torch.equal(t, shards[0]):
            raise ConversionError(f"{name}: replicated tensor differs between TP ranks {ranks[0]} and {r}")
    return shards[0]


class Replicated:
    def split(self, t, s):
        return [t] * s.tp

    def merge(self, shards, s, name):
        return _same(name, shards, list(range(len(shards))))


class Column:
    dim = 0

    def split(self, t, s):
        if t.shape[self.dim] % s.tp:
            raise ConversionError(f"dim {self.dim} of size {t.shape[self.dim]} does not split over {s.tp} ranks")
        return list(t.chunk(s.tp, self.dim))

    def merge(self, shards, s, name):
        return shards[0] if len(shards) == 1 else torch.cat(shards, self.dim)  # TP=1: no copy


class Row(Column):
    dim = 1


class Vocab(Column):
    """Word embeddings / output layer: zero rows up to the padded vocab, then column-parallel."""

    def split(self, t, s):
        if s.padded_vocab > t.shape[0]:
            t = F.pad(t, (0, 0, 0, s.padded_vocab - t.shape[0]))
        return super().split(t, s)

    def merge(self, shards, s, name):
        return super().merge(shards, s, name)[: s.vocab]


class QKV(Column):
    """Fused `[q heads of group | k | v]` per group (weight rows or bias entries)."""

    def _kv_replicated(self, s):
        return s.dialect not in MCORE_DIALECTS and s.groups < s.tp

    def split(self, t, s):
        if not self._kv_replicated(s):
            return super().split(t, s)
        per_group, q_rows = s.tp // s.groups, s.n_head // s.tp * s.head_dim
        out = []
        for rank in range(s.tp):
            group = t.chunk(s.groups, 0)[rank // per_group]
            q, kv = group[: group.shape[0] - 2 * s.head_dim], group[group.shape[0] - 2 * s.head_dim:]
            sub = rank % per_group
            out.append(torch.cat([q[sub * q_rows:(sub + 1) * q_rows], kv]))
        return out

    def merge(self, shards, s, name):
        if not self._kv_replicated(s):
            return super().merge(shards, s, name)
        per_group, kv_rows = s.tp // s.groups, 2 * s.head_dim
        groups = []
        for g in range(s.groups):
            ranks = list(range(g * per_group, (g + 1) * per_group))
            kv = _same(f"{name} (K/V rows)", [shards[r][-kv_rows:] for r in ranks], ranks)
            groups += [shards[r][:-kv_rows] for r in ranks] + [kv]
        return torch.cat(groups)


class Part:
    """A row range of a fused HF tensor stored as its own Megatron tensor (BigCode's query / key_value)."""

    def __init__(self, which: str, inner):
        self.which, self.inner = which, inner

    def rows(self, s) -> slice:
        q = s.n_head * s.head_dim
        return slice(0, q) if self.which == "q" else slice(q, None)

    def split(self, t, s):
        return self.inner.split(t[self.rows(s)], s)

    def merge(self, shards, s, name):
        return self.inner.merge(shards, s, name)


REPLICATED, COLUMN, ROW, VOCAB, FUSED_QKV = Replicated(), Column(), Row(), Vocab(), QKV()

# --------------------------------------------------------------------------- the table
# Legacy names are paths in the nested checkpoint dict, '/' separating the levels:
#   ckpt['model']['language_model']['encoder']['layers.0.input_layernorm.weight'].
# The BigCode fork uses the legacy names, except for multi-query attention (BIGCODE_MQA below).
# {i} is the layer index.
_L = "language_model/encoder/layers.{i}."
TABLE = [
    # HF name                          megatron-core name                                 legacy / BigCode name                          rule
    ("transformer.wte.weight",          "embedding.word_embeddings.weight",                "language_model/embedding/word_embeddings/weight", VOCAB),
    ("transformer.wpe.weight",          "embedding.position_embeddings.weight",            "language_model/embedding/position_embeddings/weight", REPLICATED),
    ("transformer.h.{i}.ln_1.weight",   "decoder.layers.{i}.input_layernorm.weight",       _L + "input_layernorm.weight",                 REPLICATED),
    ("transformer.h.{i}.ln_1.bias",     "decoder.layers.{i}.input_layernorm.bias",         _L + "input_layernorm.bias",                   REPLICATED),
    ("transformer.h.{i}.attn.c_attn.weight", "decoder.layers.{i}.self_attention.linear_qkv.weight", _L + "self_attention.query_key_value.weight", FUSED_QKV),
    ("transformer.h.{i}.attn.c_attn.bias",   "decoder.layers.{i}.self_attention.linear_qkv.bias",   _L + "self_attention.query_key_value.bias",   FUSED_QKV),
    ("transformer.h.{i}.attn.c_proj.weight", "decoder.layers.{i}.self_attention.linear_proj.weight", _L + "self_attention.dense.weight",         ROW),
    ("transformer.h.{i}.attn.c_proj.bias",   "decoder.layers.{i}.self_attention.linear_proj.bias",   _L + "self_attention.dense.bias",           REPLICATED),
    ("transformer.h.{i}.ln_2.weight",   "decoder.layers.{i}.pre_mlp_layernorm.weight",     _L + "post_attention_layernorm.weight",        REPLICATED),
    ("transformer.h.{i}.ln_2.bias",     "decoder.layers.{i}.pre_mlp_layernorm.bias",       _L + "post_attention_layernorm.bias",          REPLICATED),
    ("transformer.h.{i}.mlp.c_fc.weight",   "decoder.layers.{i}.mlp.linear_fc1.weight",    _L + "mlp.dense_h_to_4h.weight",               COLUMN),
    ("transformer.h.{i}.mlp.c_fc.bias",     "decoder.layers.{i}.mlp.linear_fc1.bias",      _L + "mlp.dense_h_to_4h.bias",                 COLUMN),
    ("transformer.h.{i}.mlp.c_proj.weight", "decoder.layers.{i}.mlp.linear_fc2.weight",    _L + "mlp.dense_4h_to_h.weight",               ROW),
    ("transformer.h.{i}.mlp.c_proj.bias",   "decoder.layers.{i}.mlp.linear_fc2.bias",      _L + "mlp.dense_4h_to_h.bias",                 REPLICATED),
    ("transformer.ln_f.weight",         "decoder.final_layernorm.weight",                  "language_model/encoder/final_layernorm.weight", REPLICATED),
    ("transformer.ln_f.bias",           "decoder.final_layernorm.bias",                    "language_model/encoder/final_layernorm.bias", REPLICATED),
    ("lm_head.weight",                  "output_layer.weight",                             "language_model/output_layer/weight",          VOCAB),  # untied only
]
# BigCode fork, attention_head_type=multiquery: c_attn = cat([query, key_value]); query is
# column-parallel, the single K/V head replicated.
BIGCODE_MQA = {
    "transformer.h.{i}.attn.c_attn.weight": [(_L + "self_attention.query.weight", Part("q", COLUMN)),
                                             (_L + "self_attention.key_value.weight", Part("kv", REPLICATED))],
    "transformer.h.{i}.attn.c_attn.bias": [(_L + "self_attention.query.bias", Part("q", COLUMN)),
                                           (_L + "self_attention.key_value.bias", Part("kv", REPLICATED))],
}


def entries(config: GPTBigCodeConfig, s: Layout):
    """(layer or None, HF name, [(Megatron name, rule), ...]) for every hub tensor, in model order."""
    col = 1 if s.dialect in MCORE_DIALECTS else 2
    for row in TABLE:
        hf, rule = row[0], row[3]
        if hf == "lm_head.weight" and config.tie_word_embeddings:
            continue
        targets = BIGCODE_MQA.get(hf) if s.split_qkv else None
        targets = targets or [(te_name(row[col]) if s.dialect == "mcore-te" else row[col], rule)]
        layers = range(config.n_layer) if "{i}" in hf else [None]
        for i in layers:
            yield i, hf.format(i=i), [(name.format(i=i), r) for name, r in targets]


def _by_layer(config, s):
    """Entries in model order (embeddings, layer 0, ..., layer n-1, final norm, head)."""
    items = list(entries(config, s))
    def order(e):
        return -1 if e[0] is None and "transformer.w" in e[1] else (config.n_layer if e[0] is None else e[0])
    return sorted(items, key=order)


# --------------------------------------------------------------------------- hub checks

def _check_keys(what: str, got, want) -> None:
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing:
        raise ConversionError(f"{what}: missing {len(missing)} tensor(s), e.g. {', '.join(missing[:3])}")
    if extra:
        raise ConversionError(f"{what}: {len(extra)} unexpected tensor(s), e.g. {', '.join(extra[:3])}")


def check_hf_state(hf_state: dict, config: GPTBigCodeConfig, what: str = "HF state") -> None:
    """Raise ConversionError naming the first missing/extra/misshapen tensor."""
    shapes = hf_shapes(config)
    state = dict(hf_state)
    if config.tie_word_embeddings and "lm_head.weight" in state:
        state.pop("lm_head.weight")  # some writers save the tied head too
    _check_keys(what, state, shapes)
    for name, shape in shapes.items():
        if tuple(state[name].shape) != shape:
            raise ConversionError(f"{what}: {name} has shape {tuple(state[name].shape)}, expected {shape}")


# --------------------------------------------------------------------------- split / merge

def hf_to_megatron(hf_state: dict, config: GPTBigCodeConfig, dialect: str, tp_size: int = 1,
                   padded_vocab_size: int | None = None, progress=None) -> list[dict]:
    """Hub -> one flat state dict per TP rank, in the given dialect's names."""
    s = Layout(config, tp_size, padded_vocab_size, dialect)
    check_hf_state(hf_state, config)
    ranks = [{} for _ in range(tp_size)]
    if progress is not None:
        progress.reset(total=config.n_layer)
    layer = -1
    for i, hf, targets in _by_layer(config, s):
        if progress is not None and i is not None and i != layer:
            layer = i
            progress.update(1)
        for name, rule in targets:
            for rank, shard in zip(ranks, rule.split(hf_state[hf], s)):
                rank[name] = shard.contiguous()
    return ranks


def megatron_to_hf(rank_states: list[dict], config: GPTBigCodeConfig, dialect: str,
                   padded_vocab_size: int | None = None, progress=None) -> dict:
    """One flat state dict per TP rank -> hub. Checks names and shard shapes on every rank."""
    tp = len(rank_states)
    if padded_vocab_size is None:  # infer from the embedding shard
        name = TABLE[0][1 if dialect in MCORE_DIALECTS else 2]
        if name in rank_states[0]:
            padded_vocab_size = rank_states[0][name].shape[0] * tp
    s = Layout(config, tp, padded_vocab_size, dialect)
    items = _by_layer(config, s)
    want = {name for _, _, targets in items for name, _ in targets}
    for r, state in enumerate(rank_states):
        _check_keys(f"TP rank {r}", state, want)
    # Shard shapes: split meta tensors of the hub shapes with the same rules.
    shapes = hf_shapes(config)
    if progress is not None:
        progress.reset(total=config.n_layer)
    hub, layer = {}, -1
    for i, hf, targets in items:
        if progress is not None and i is not None and i != layer:
            layer = i
            progress.update(1)
        parts = []
        for name, rule in targets:
            expected = rule.split(torch.empty(shapes[hf], device="meta"), s)
            for r, state in enumerate(rank_states):
                if tuple(state[name].shape) != tuple(expected[r].shape):
                    raise ConversionError(f"TP rank {r}: {name} has shape {tuple(state[name].shape)}, "
                                          f"expected {tuple(expected[r].shape)}")
            parts.append(rule.merge([state[name] for state in rank_states], s, name))
        hub[hf] = parts[0] if len(parts) == 1 else torch.cat(parts)
    return hub


def hf_to_mcore(hf_state: dict, config: GPTBigCodeConfig, tp_size: int = 1,
                padded_vocab_size: int | None = None) -> list[dict]:
    """Hub -> per-rank megatron-core `GPTModel.state_dict()` (local spec), without `_extra_state`.

    `padded_vocab_size` defaults to vocab_size rounded up to a multiple of 128 * tp_size.
    """
    return hf_to_megatron(hf_state, config, "mcore", tp_size, padded_vocab_size)


def mcore_to_hf(rank_states: list[dict], config: GPTBigCodeConfig) -> dict:
    """Inverse of `hf_to_mcore`; `_extra_state` keys are ignored, replicated tensors must agree."""
    rank_states = [{k: v for k, v in st.items() if not k.endswith("._extra_state")} for st in rank_states]
    return megatron_to_hf(rank_states, config, "mcore")

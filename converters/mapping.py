"""The one mapping table between HF names (gpt_bigcode and starcoder2) and Megatron names, and the TP rules.

Every conversion goes through the *hub*: an HF-named full state dict (`lm_head.weight` absent
when tied) plus its HF config, `GPTBigCodeConfig` or `Starcoder2Config`. `TABLE` lists, for each
tensor, its gpt_bigcode name, its megatron-core name, its Megatron-LM legacy name, how it is
partitioned over tensor-parallel ranks, and its starcoder2 name (the family column: None where
StarCoder2 has no such tensor, i.e. the learned position embeddings, which RoPE replaces);
splitting (hub -> rank state dicts) and merging (rank state dicts -> hub) are both derived from it.

`hf_to_mcore` / `mcore_to_hf` are the API the megatron-core adapter (`plugins/megatron`, the
`megatron` checkpoint format) uses: one state dict per TP rank with exactly the names and shapes
of `GPTModel.state_dict()` (local layer spec), without the `_extra_state` keys.

Attention layout. All formats store the fused QKV per query group as `[q heads of the group | k | v]`
(megatron-core `linear_qkv`, Megatron-LM `query_key_value` since checkpoint_version 2). With one
group that is HF's MQA `c_attn` `[Q | K | V]`; with n_head groups it is HF's MHA per-head
`[q_h, k_h, v_h]`; so the hub keeps `c_attn` in that grouped layout for any number of groups and
no reordering is ever needed. GQA (1 < groups < n_head) of gpt_bigcode exists only on the Megatron
side: the hub config then carries `num_query_groups` and `multi_query=False`, and writing it as HF
is an error (HF gpt_bigcode implements only MQA and MHA). StarCoder2 is GQA natively: its separate
`q_proj`, `k_proj`, `v_proj` are fused into that per-group layout on the way to Megatron and cut
apart on the way back (`GroupedQKV`), exact either way (a copy, no arithmetic).

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
from plugins.core.config import TANH_GELUS, ConfigError, arch, check_tp, hf_shapes, kv_heads
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
    activation = arch(config).activation
    if activation not in TANH_GELUS + ("gelu",):
        raise ConversionError(f"activation {activation!r} has no Megatron equivalent; "
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
        shape = arch(config)
        self.n_head, self.groups, self.tp, self.dialect = shape.n_head, kv_heads(config), tp, dialect
        self.head_dim, self.family = shape.head_dim, shape.family
        self.vocab = config.vocab_size
        self.padded_vocab = padded_vocab or padded_vocab_size(config.vocab_size, tp)
        if self.padded_vocab < self.vocab or self.padded_vocab % tp:
            raise ConversionError(f"padded vocab {self.padded_vocab} must be >= vocab_size {self.vocab} "
                                  f"and divisible by tp_size {tp}")
        if dialect == "bigcode" and self.family != "gpt_bigcode":
            raise ConversionError(f"the BigCode Megatron-LM fork stores gpt_bigcode models (learned positions), "
                                  f"not {self.family}")
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

class GroupedQKV:
    """StarCoder2's `q_proj`, `k_proj`, `v_proj` (weights or biases) as one hub tensor in the fused per-group
    layout `[q heads of the group | k | v]` that the QKV rule splits, and back."""

    def __init__(self, *names: str):
        self.names = names

    def format(self, i: int) -> "GroupedQKV":
        return GroupedQKV(*(n.format(i=i) for n in self.names))

    def fuse(self, q, k, v, s):
        g, rest = s.groups, q.shape[1:]
        parts = [q.reshape(g, -1, *rest), k.reshape(g, s.head_dim, *rest), v.reshape(g, s.head_dim, *rest)]
        return torch.cat(parts, 1).reshape(-1, *rest)

    def unfuse(self, t, s) -> dict:
        per, d, rest = s.n_head // s.groups * s.head_dim, s.head_dim, t.shape[1:]
        grouped = t.reshape(s.groups, per + 2 * d, *rest)
        q, k, v = grouped[:, :per], grouped[:, per:per + d], grouped[:, per + d:]
        return {name: x.reshape(-1, *rest).contiguous() for name, x in zip(self.names, (q, k, v))}

    def get(self, state: dict, s):
        return self.fuse(*(state[n] for n in self.names), s)


def hub_get(state: dict, hf, s):
    """The tensor the rules split: one hub tensor, or StarCoder2's three fused."""
    return hf.get(state, s) if isinstance(hf, GroupedQKV) else state[hf]


def hub_put(hub: dict, hf, t, s) -> None:
    if isinstance(hf, GroupedQKV):
        hub.update(hf.unfuse(t, s))
    else:
        hub[hf] = t


def hub_shape(shapes: dict, hf, s) -> tuple:
    if isinstance(hf, GroupedQKV):
        return tuple(hf.fuse(*(torch.empty(shapes[n], device="meta") for n in hf.names), s).shape)
    return shapes[hf]


# --------------------------------------------------------------------------- the table
# Legacy names are paths in the nested checkpoint dict, '/' separating the levels:
#   ckpt['model']['language_model']['encoder']['layers.0.input_layernorm.weight'].
# The BigCode fork uses the legacy names, except for multi-query attention (BIGCODE_MQA below).
# {i} is the layer index. The last column is the starcoder2 family's HF name.
_L = "language_model/encoder/layers.{i}."
_S = "model.layers.{i}."
_SQKV = {kind: GroupedQKV(*(f"{_S}self_attn.{p}_proj.{kind}" for p in "qkv")) for kind in ("weight", "bias")}
TABLE = [
    # HF gpt_bigcode name              megatron-core name                                 legacy / BigCode name                          rule        HF starcoder2 name
    ("transformer.wte.weight",          "embedding.word_embeddings.weight",                "language_model/embedding/word_embeddings/weight", VOCAB,  "model.embed_tokens.weight"),
    ("transformer.wpe.weight",          "embedding.position_embeddings.weight",            "language_model/embedding/position_embeddings/weight", REPLICATED, None),  # RoPE
    ("transformer.h.{i}.ln_1.weight",   "decoder.layers.{i}.input_layernorm.weight",       _L + "input_layernorm.weight",                 REPLICATED, _S + "input_layernorm.weight"),
    ("transformer.h.{i}.ln_1.bias",     "decoder.layers.{i}.input_layernorm.bias",         _L + "input_layernorm.bias",                   REPLICATED, _S + "input_layernorm.bias"),
    ("transformer.h.{i}.attn.c_attn.weight", "decoder.layers.{i}.self_attention.linear_qkv.weight", _L + "self_attention.query_key_value.weight", FUSED_QKV, _SQKV["weight"]),
    ("transformer.h.{i}.attn.c_attn.bias",   "decoder.layers.{i}.self_attention.linear_qkv.bias",   _L + "self_attention.query_key_value.bias",   FUSED_QKV, _SQKV["bias"]),
    ("transformer.h.{i}.attn.c_proj.weight", "decoder.layers.{i}.self_attention.linear_proj.weight", _L + "self_attention.dense.weight",         ROW,        _S + "self_attn.o_proj.weight"),
    ("transformer.h.{i}.attn.c_proj.bias",   "decoder.layers.{i}.self_attention.linear_proj.bias",   _L + "self_attention.dense.bias",           REPLICATED, _S + "self_attn.o_proj.bias"),
    ("transformer.h.{i}.ln_2.weight",   "decoder.layers.{i}.pre_mlp_layernorm.weight",     _L + "post_attention_layernorm.weight",        REPLICATED, _S + "post_attention_layernorm.weight"),
    ("transformer.h.{i}.ln_2.bias",     "decoder.layers.{i}.pre_mlp_layernorm.bias",       _L + "post_attention_layernorm.bias",          REPLICATED, _S + "post_attention_layernorm.bias"),
    ("transformer.h.{i}.mlp.c_fc.weight",   "decoder.layers.{i}.mlp.linear_fc1.weight",    _L + "mlp.dense_h_to_4h.weight",               COLUMN,     _S + "mlp.c_fc.weight"),
    ("transformer.h.{i}.mlp.c_fc.bias",     "decoder.layers.{i}.mlp.linear_fc1.bias",      _L + "mlp.dense_h_to_4h.bias",                 COLUMN,     _S + "mlp.c_fc.bias"),
    ("transformer.h.{i}.mlp.c_proj.weight", "decoder.layers.{i}.mlp.linear_fc2.weight",    _L + "mlp.dense_4h_to_h.weight",               ROW,        _S + "mlp.c_proj.weight"),
    ("transformer.h.{i}.mlp.c_proj.bias",   "decoder.layers.{i}.mlp.linear_fc2.bias",      _L + "mlp.dense_4h_to_h.bias",                 REPLICATED, _S + "mlp.c_proj.bias"),
    ("transformer.ln_f.weight",         "decoder.final_layernorm.weight",                  "language_model/encoder/final_layernorm.weight", REPLICATED, "model.norm.weight"),
    ("transformer.ln_f.bias",           "decoder.final_layernorm.bias",                    "language_model/encoder/final_layernorm.bias", REPLICATED, "model.norm.bias"),
    ("lm_head.weight",                  "output_layer.weight",                             "language_model/output_layer/weight",          VOCAB,      "lm_head.weight"),  # untied only
]
EMBEDDING_ROWS = 2  # the table's first rows come before the layers
# BigCode fork, attention_head_type=multiquery: c_attn = cat([query, key_value]); query is
# column-parallel, the single K/V head replicated.
BIGCODE_MQA = {
    "transformer.h.{i}.attn.c_attn.weight": [(_L + "self_attention.query.weight", Part("q", COLUMN)),
                                             (_L + "self_attention.key_value.weight", Part("kv", REPLICATED))],
    "transformer.h.{i}.attn.c_attn.bias": [(_L + "self_attention.query.bias", Part("q", COLUMN)),
                                           (_L + "self_attention.key_value.bias", Part("kv", REPLICATED))],
}


def entries(config: GPTBigCodeConfig, s: Layout):
    """(layer or None, HF name (a `GroupedQKV` for StarCoder2's attention), [(Megatron name, rule), ...]) for
    every hub tensor, in model order (embeddings, layer 0, ..., layer n-1, final norm, head)."""
    col = 1 if s.dialect in MCORE_DIALECTS else 2
    n_layer = arch(config).n_layer
    items = []
    for index, row in enumerate(TABLE):
        hf, rule = (row[0] if s.family == "gpt_bigcode" else row[4]), row[3]
        if hf is None or (row[0] == "lm_head.weight" and config.tie_word_embeddings):
            continue
        targets = BIGCODE_MQA.get(row[0]) if s.split_qkv else None
        targets = targets or [(te_name(row[col]) if s.dialect == "mcore-te" else row[col], rule)]
        layers = range(n_layer) if "{i}" in row[0] else [None]
        for i in layers:
            order = i if i is not None else (-1 if index < EMBEDDING_ROWS else n_layer)
            items.append((order, i, hf.format(i=i), [(name.format(i=i), r) for name, r in targets]))
    return [item[1:] for item in sorted(items, key=lambda item: item[0])]


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
        progress.reset(total=arch(config).n_layer)
    layer = -1
    for i, hf, targets in entries(config, s):
        if progress is not None and i is not None and i != layer:
            layer = i
            progress.update(1)
        for name, rule in targets:
            for rank, shard in zip(ranks, rule.split(hub_get(hf_state, hf, s), s)):
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
    items = entries(config, s)
    want = {name for _, _, targets in items for name, _ in targets}
    for r, state in enumerate(rank_states):
        _check_keys(f"TP rank {r}", state, want)
    # Shard shapes: split meta tensors of the hub shapes with the same rules.
    shapes = hf_shapes(config)
    if progress is not None:
        progress.reset(total=arch(config).n_layer)
    hub, layer = {}, -1
    for i, hf, targets in items:
        if progress is not None and i is not None and i != layer:
            layer = i
            progress.update(1)
        parts = []
        for name, rule in targets:
            expected = rule.split(torch.empty(hub_shape(shapes, hf, s), device="meta"), s)
            for r, state in enumerate(rank_states):
                if tuple(state[name].shape) != tuple(expected[r].shape):
                    raise ConversionError(f"TP rank {r}: {name} has shape {tuple(state[name].shape)}, "
                                          f"expected {tuple(expected[r].shape)}")
            parts.append(rule.merge([state[name] for state in rank_states], s, name))
        hub_put(hub, hf, parts[0] if len(parts) == 1 else torch.cat(parts), s)
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

"""What each output format's consumer loads, strictly, and the check of a written output against it.

The expected names come from the consumers, never from the mapping table the writers use, so a writer
that names a tensor wrongly fails its conversion (one ConversionError naming the key) before the output
is published:
- megatron-core (`megatron`, `megatron-torch`): a real `GPTModel` built on the meta device (no memory,
  milliseconds) with process groups that only answer size and rank, so that megatron-core itself sizes
  every TP shard; its `state_dict()` (what `load_state_dict(strict=True)` wants) or `sharded_state_dict()`
  (what `dist_checkpointing.load` with `StrictHandling.RAISE_ALL` wants).
- The Transformer Engine layer spec cannot be built without transformer_engine: its names are the local
  spec's under megatron-core's own `sharded_state_dict_keys_map` (read from the spec at run time), plus
  the `_extra_state` of every TE module (TE's `get_extra_state`: an empty uint8 tensor without FP8).
- NVIDIA Megatron-LM's legacy GPT model (core_v0.17.x and before) and BigCode's fork: their layers'
  state-dict names, written out below from their sources.
- HF: `GPTBigCodeForCausalLM` built on the meta device (the tied head is not stored).

An expectation maps each key to a shape tuple, TENSOR (any tensor) or None (the value must be None:
megatron-core's local linears save `_extra_state` as None, and a strict load requires the key).
"""

from __future__ import annotations

from contextlib import contextmanager
from unittest import mock

import torch
from transformers import GPTBigCodeConfig

from converters.errors import ConversionError
from plugins.core.checkpoint import model_class
from plugins.core.config import arch, head_dim, kv_heads

TENSOR = "tensor"

# NVIDIA Megatron-LM megatron/legacy/model/transformer.py (core_v0.17.1): a ParallelTransformerLayer's
# state dict. Its linears are megatron-core's Column/RowParallelLinear, whose `_extra_state` (None) a strict
# load requires; ParallelTransformer.load_state_dict renames "layernorm" -> "norm" in every key first.
NVIDIA_LEGACY_LAYER = {
    "input_norm.weight": TENSOR, "input_norm.bias": TENSOR,
    "self_attention.query_key_value.weight": TENSOR, "self_attention.query_key_value.bias": TENSOR,
    "self_attention.query_key_value._extra_state": None,
    "self_attention.dense.weight": TENSOR, "self_attention.dense.bias": TENSOR,
    "self_attention.dense._extra_state": None,
    "post_attention_norm.weight": TENSOR, "post_attention_norm.bias": TENSOR,
    "mlp.dense_h_to_4h.weight": TENSOR, "mlp.dense_h_to_4h.bias": TENSOR, "mlp.dense_h_to_4h._extra_state": None,
    "mlp.dense_4h_to_h.weight": TENSOR, "mlp.dense_4h_to_h.bias": TENSOR, "mlp.dense_4h_to_h._extra_state": None,
}
# BigCode's fork, megatron/model/transformer.py: its own parallel linears keep no extra state; multi-query
# attention is `query` + `key_value`.
_FORK_COMMON = ("input_layernorm.weight", "input_layernorm.bias", "self_attention.dense.weight",
                "self_attention.dense.bias", "post_attention_layernorm.weight", "post_attention_layernorm.bias",
                "mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias", "mlp.dense_4h_to_h.weight",
                "mlp.dense_4h_to_h.bias")
FORK_LAYER = {
    "multiquery": _FORK_COMMON + ("self_attention.query.weight", "self_attention.query.bias",
                                  "self_attention.key_value.weight", "self_attention.key_value.bias"),
    "multihead": _FORK_COMMON + ("self_attention.query_key_value.weight", "self_attention.query_key_value.bias"),
}
# Transformer Engine modules of get_gpt_layer_with_transformer_engine_spec() with an extra state the local
# spec's modules do not have: the attention core (TEDotProductAttention) and the final norm (TENorm).
TE_EXTRA_STATE_LAYER = ("self_attention.core_attention._extra_state",)
TE_EXTRA_STATE_FINAL = "decoder.final_layernorm._extra_state"
TE_EMPTY_EXTRA_STATE = (0,)


# --------------------------------------------------------------------------- the check

def describe(value):
    """A stored value as an expectation compares it: its shape, or None."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    return type(value).__name__  # anything else matches no expectation


def flat_values(tree: dict, prefix: str = "", sep: str = "/") -> dict:
    """A nested checkpoint dict -> {path: described value}, keeping None values (unlike megatron_pt.flatten)."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat_values(v, f"{prefix}{k}{sep}", sep))
        else:
            out[f"{prefix}{k}"] = describe(v)
    return out


def check_strict(where: str, got: dict, want: dict, consumer: str) -> None:
    """One ConversionError naming the first key a strict load by `consumer` would refuse."""
    missing, unexpected = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if unexpected or missing:
        first = f"unexpected key {unexpected[0]!r}" if unexpected else f"missing key {missing[0]!r}"
        more = len(missing) + len(unexpected) - 1
        also = (f" (and {more} more{', e.g. missing ' + repr(missing[0]) if unexpected and missing else ''})"
                if more else "")
        raise ConversionError(f"{where}: {consumer} would refuse it in a strict load: {first}{also}")
    for key, w in want.items():
        g = got[key]
        ok = g is None if w is None else isinstance(g, tuple) if w == TENSOR else g == w
        if not ok:
            raise ConversionError(f"{where}: {consumer} would refuse it in a strict load: {key} is {g!r}, "
                                  f"it expects {'None' if w is None else w!r}")


# --------------------------------------------------------------------------- megatron-core GPTModel

class _Group:
    """Answers what megatron-core asks a process group while building a model: its size and our rank."""

    def __init__(self, size: int = 1, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@contextmanager
def _sized_groups():
    # megatron-core's get_pg_size / get_pg_rank ask the group only once torch.distributed is up.
    with mock.patch("torch.distributed.is_initialized", return_value=True):
        yield


def _megatron_core():
    """megatron.core's model classes, imported without its warnings about optional CUDA extensions."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine|transformer_engine).*")
        from megatron.core.models.gpt import GPTModel, gpt_layer_specs
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.transformer_config import TransformerConfig
    return GPTModel, gpt_layer_specs, ProcessGroupCollection, TransformerConfig


def gptmodel(config: GPTBigCodeConfig, padded_vocab: int, tp: int = 1, tp_rank: int = 0, n_layers: int | None = None,
             pre_process: bool = True, post_process: bool = True):
    """megatron-core's GPTModel (local layer spec) for one TP rank and pipeline stage, on the meta device:
    the architecture fields that decide its tensors' names and shapes (plugins/megatron/model.py maps the rest)."""
    GPTModel, gpt_layer_specs, ProcessGroupCollection, TransformerConfig = _megatron_core()
    a = arch(config)
    tc = TransformerConfig(
        num_layers=a.n_layer if n_layers is None else n_layers, hidden_size=a.hidden,
        num_attention_heads=a.n_head, num_query_groups=kv_heads(config), kv_channels=head_dim(config),
        ffn_hidden_size=a.inner, normalization="LayerNorm",
        layernorm_epsilon=a.eps, add_bias_linear=True, add_qkv_bias=True,
        tensor_model_parallel_size=tp, perform_initialization=False, use_cpu_initialization=True,
        gradient_accumulation_fusion=False, persist_layer_norm=False, masked_softmax_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, sequence_parallel=False, cuda_graph_scope=[])
    one, tp_group = _Group(), _Group(tp, tp_rank)
    pg = ProcessGroupCollection(tp=tp_group, pp=one, cp=one, embd=one, pos_embd=one, dp_cp=one)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="LayerNorm")
    positions = {"position_embedding_type": "rope", "rotary_base": a.rope_theta} if a.rope else {
        "position_embedding_type": "learned_absolute"}
    with _sized_groups(), torch.device("meta"):
        model = GPTModel(config=tc, transformer_layer_spec=spec, vocab_size=padded_vocab,
                         max_sequence_length=a.n_positions, pre_process=pre_process, post_process=post_process,
                         share_embeddings_and_output_weights=a.tied, pg_collection=pg, **positions)
    return model, spec


def mcore_state_keys(config: GPTBigCodeConfig, padded_vocab: int, spec: str = "local", tp: int = 1, tp_rank: int = 0,
                     n_layers: int | None = None, pre_process: bool = True, post_process: bool = True) -> dict:
    """What `GPTModel.load_state_dict(strict=True)` of this rank and stage wants: key -> shape or None."""
    model, local_spec = gptmodel(config, padded_vocab, tp, tp_rank, n_layers, pre_process, post_process)
    want = {k: describe(v) for k, v in model.state_dict().items()}
    if spec == "local":
        return want
    keys_map = local_spec.submodules.sharded_state_dict_keys_map  # local layer norms -> TE's fused names
    te = {}
    for key, value in want.items():
        if key.startswith("decoder.layers."):
            index, rest = key[len("decoder.layers."):].split(".", 1)
            for old, new in keys_map.items():
                if rest.startswith(old):
                    rest = new + rest[len(old):]
            if rest.endswith("._extra_state"):
                value = TE_EMPTY_EXTRA_STATE
            key = f"decoder.layers.{index}.{rest}"
        te[key] = value
    for i in range(len(model.decoder.layers)):
        for name in TE_EXTRA_STATE_LAYER:
            te[f"decoder.layers.{i}.{name}"] = TE_EMPTY_EXTRA_STATE
    if post_process:
        te[TE_EXTRA_STATE_FINAL] = TE_EMPTY_EXTRA_STATE
    return te


def mcore_sharded_keys(config: GPTBigCodeConfig, padded_vocab: int) -> dict:
    """What `dist_checkpointing.load(GPTModel.sharded_state_dict(), strict=RAISE_ALL)` wants: every
    ShardedTensor's key -> its global shape, every ShardedObject's unique key -> None."""
    model, _ = gptmodel(config, padded_vocab)  # first: imports megatron.core quietly
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    want = {}
    for sh in nested_values(model.sharded_state_dict(metadata={"dp_cp_group": _Group()})):
        if isinstance(sh, ShardedTensor):
            want[sh.key] = tuple(sh.global_shape)
        elif isinstance(sh, ShardedObject):
            want[sh.unique_key] = None
    return want


# --------------------------------------------------------------------------- Megatron-LM legacy, BigCode fork

def legacy_stage_keys(n_layers: int, first: bool, last: bool, tied: bool, pp: int,
                      fork_heads: str | None = None, learned_positions: bool = True) -> dict:
    """A legacy-model stage file's flattened keys ('/' between levels) as NVIDIA's legacy GPT model (fork_heads
    None) or BigCode's fork ("multiquery" / "multihead") loads them, after NVIDIA's layernorm -> norm rename.
    With RoPE (`learned_positions` False) the embedding has no position table (its RotaryEmbedding keeps
    no state)."""
    want = {}
    if first:
        want["language_model/embedding/word_embeddings/weight"] = TENSOR
        if learned_positions:
            want["language_model/embedding/position_embeddings/weight"] = TENSOR
    layer = NVIDIA_LEGACY_LAYER if fork_heads is None else dict.fromkeys(FORK_LAYER[fork_heads], TENSOR)
    for i in range(n_layers):
        want.update({f"language_model/encoder/layers.{i}.{name}": kind for name, kind in layer.items()})
    if last:
        norm = "final_norm" if fork_heads is None else "final_layernorm"
        want[f"language_model/encoder/{norm}.weight"] = want[f"language_model/encoder/{norm}.bias"] = TENSOR
        if not tied:
            want["language_model/output_layer/weight"] = TENSOR
            if fork_heads is None:
                want["language_model/output_layer/_extra_state"] = None
        elif pp > 1:
            want["word_embeddings_for_head/weight"] = TENSOR
    return want


def nvidia_legacy_view(got: dict) -> dict:
    """The keys as NVIDIA's ParallelTransformer.load_state_dict passes them on (layernorm -> norm)."""
    enc = "language_model/encoder/"
    return {(enc + k[len(enc):].replace("layernorm", "norm") if k.startswith(enc) else k): v for k, v in got.items()}


# --------------------------------------------------------------------------- HF

def hf_keys(config: GPTBigCodeConfig) -> dict:
    """The HF model's state dict (GPTBigCodeForCausalLM or Starcoder2ForCausalLM: shapes), without the tied
    head that is not stored."""
    with torch.device("meta"):
        model = model_class(config)(config)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        want.pop("lm_head.weight", None)
    return want

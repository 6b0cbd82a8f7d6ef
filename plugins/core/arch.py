"""The model-family seam: one normalized view (`Arch`) of an HF config of either family this project
serves, so code that needs a model's shape asks `arch(config)` instead of reading one family's names.

- `gpt_bigcode` (SantaCoder, StarCoder): MQA or MHA (or GQA via `num_query_groups`, Megatron
  formats only), learned absolute positions, fused `c_attn`.
- `starcoder2` (StarCoder2 3B / 7B / 15B): GQA with `num_key_value_heads`, RoPE, sliding-window
  attention, separate q / k / v projections; LayerNorm with bias and a tanh-GELU MLP like gpt_bigcode.

Everything here only reads attributes: `plugins.core.config.check_hf_config` validates them.
"""

from __future__ import annotations

from dataclasses import dataclass

from plugins.core.errors import ConfigError

# family -> (Arch field -> the family's HF config attribute)
NAMES = {
    "gpt_bigcode": {"n_layer": "n_layer", "hidden": "n_embd", "n_head": "n_head", "vocab_size": "vocab_size",
                    "n_positions": "n_positions", "inner": "n_inner", "eps": "layer_norm_epsilon",
                    "activation": "activation_function"},
    "starcoder2": {"n_layer": "num_hidden_layers", "hidden": "hidden_size", "n_head": "num_attention_heads",
                   "vocab_size": "vocab_size", "n_positions": "max_position_embeddings",
                   "inner": "intermediate_size", "eps": "norm_epsilon", "activation": "hidden_act"},
}
FAMILIES = tuple(NAMES)
# config.json's model class per family: vLLM and AutoModel pick the implementation by it
ARCHITECTURES = {"gpt_bigcode": "GPTBigCodeForCausalLM", "starcoder2": "Starcoder2ForCausalLM"}


@dataclass(frozen=True)
class Arch:
    family: str
    n_layer: int
    hidden: int
    n_head: int
    kv_heads: int              # KV heads of the whole model (1: MQA, n_head: MHA, else GQA)
    vocab_size: int
    n_positions: int
    inner: int                 # MLP width
    eps: float
    activation: str
    tied: bool                 # LM head tied to the token embedding
    rope_theta: float | None   # None: learned absolute position embeddings
    sliding_window: int | None  # a query sees itself and the window - 1 tokens before it; None: all

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_head

    @property
    def rope(self) -> bool:
        return self.rope_theta is not None

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


def family(config) -> str:
    name = getattr(config, "model_type", None)
    if name not in NAMES:
        raise ConfigError(f"model type {name!r} is not served here; known: {', '.join(FAMILIES)}")
    return name


def raw(config, field: str):
    """One Arch field as the config holds it (unvalidated), under the family's own name."""
    return getattr(config, NAMES[family(config)][field], None)


def _kv_heads(config):
    if family(config) == "starcoder2":
        return config.num_key_value_heads
    return getattr(config, "num_query_groups", None) or (1 if config.multi_query else config.n_head)


def arch(config) -> Arch:
    """The normalized shape of an HF config of either family (see the module doc)."""
    fam = family(config)
    values = {field: getattr(config, name, None) for field, name in NAMES[fam].items()}
    rope_theta = window = None
    if fam == "starcoder2":
        rope_theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
        window = getattr(config, "sliding_window", None)
    values["inner"] = values["inner"] or 4 * values["hidden"]
    return Arch(family=fam, kv_heads=_kv_heads(config), tied=bool(config.tie_word_embeddings),
                rope_theta=rope_theta, sliding_window=window, **values)


def kv_heads(config) -> int:
    """KV heads of the whole model: 1 (MQA), n_head (MHA), or the GQA groups: StarCoder2's
    `num_key_value_heads`, or `num_query_groups` for the GQA gpt_bigcode configs the converters make
    (Megatron formats only: HF gpt_bigcode implements MQA and MHA)."""
    return _kv_heads(config)


def kv_heads_per_rank(config, tp_size: int = 1) -> int:
    """KV heads one TP rank holds: its share, or the whole head(s) replicated when there are fewer
    KV heads than ranks (MQA: the one head on every rank)."""
    return max(1, kv_heads(config) // tp_size)


def head_dim(config) -> int:
    return arch(config).head_dim


def _starcoder2_shapes(a: Arch) -> dict[str, tuple[int, ...]]:
    h, q, kv, inner = a.hidden, a.n_head * a.head_dim, a.kv_dim, a.inner
    shapes = {"model.embed_tokens.weight": (a.vocab_size, h)}
    for i in range(a.n_layer):
        p = f"model.layers.{i}."
        for name, out, inp in (("self_attn.q_proj", q, h), ("self_attn.k_proj", kv, h), ("self_attn.v_proj", kv, h),
                               ("self_attn.o_proj", h, q), ("mlp.c_fc", inner, h), ("mlp.c_proj", h, inner)):
            shapes.update({p + name + ".weight": (out, inp), p + name + ".bias": (out,)})
        for norm in ("input_layernorm", "post_attention_layernorm"):
            shapes.update({p + norm + ".weight": (h,), p + norm + ".bias": (h,)})
    shapes.update({"model.norm.weight": (h,), "model.norm.bias": (h,)})
    return shapes


def _gpt_bigcode_shapes(a: Arch) -> dict[str, tuple[int, ...]]:
    h, qkv, inner = a.hidden, a.hidden + 2 * a.kv_dim, a.inner
    shapes = {"transformer.wte.weight": (a.vocab_size, h), "transformer.wpe.weight": (a.n_positions, h)}
    for i in range(a.n_layer):
        p = f"transformer.h.{i}."
        shapes.update({
            p + "ln_1.weight": (h,), p + "ln_1.bias": (h,),
            p + "attn.c_attn.weight": (qkv, h), p + "attn.c_attn.bias": (qkv,),
            p + "attn.c_proj.weight": (h, h), p + "attn.c_proj.bias": (h,),
            p + "ln_2.weight": (h,), p + "ln_2.bias": (h,),
            p + "mlp.c_fc.weight": (inner, h), p + "mlp.c_fc.bias": (inner,),
            p + "mlp.c_proj.weight": (h, inner), p + "mlp.c_proj.bias": (h,),
        })
    shapes.update({"transformer.ln_f.weight": (h,), "transformer.ln_f.bias": (h,)})
    return shapes


def hf_shapes(config) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of the HF model (HF names; lm_head only when untied)."""
    a = arch(config)
    shapes = _starcoder2_shapes(a) if a.family == "starcoder2" else _gpt_bigcode_shapes(a)
    if not a.tied:
        shapes["lm_head.weight"] = (a.vocab_size, a.hidden)
    return shapes


def is_norm(name: str) -> bool:
    """Whether an HF tensor name (either family) belongs to a layer norm."""
    return any(part in name for part in (".ln_", "transformer.ln_f", "layernorm", "model.norm."))

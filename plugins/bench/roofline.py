"""The analytical inference model of Pope et al. 2022 ("Efficiently Scaling Transformer Inference").

A step costs the larger of its memory time (bytes it must read / memory bandwidth) and its compute
time (FLOPs / peak FLOP/s), plus the tensor-parallel communication that cannot overlap with it:

    time = max(bytes / mem_bw, flops / peak_flops) + comm

Everything here is per rank (one device of a TP group) and pure arithmetic on a model shape, so
the same functions predict this machine (fed the bandwidth and GEMM peak measured here) and
hardware that is not here (`configs/hardware/*.yaml`).

Counting rules, stated once:
- Weights: every parameter; under TP=N the Q / output / MLP matrices and the (tied) vocabulary
  matrix are split N ways; K/V projections are split by KV head (a head whose group spans several
  ranks is replicated: MQA's single head lives on every rank); biases, layer norms and position
  embeddings are replicated. A decode step reads every weight but the position table.
- FLOPs: 2 per multiply-add of every matmul (lm_head on the last position only, as generation
  needs), plus attention: 4 * n_embd FLOPs per layer per (query, key) pair.
- KV cache: 2 (K and V) * n_layer * batch * seq * kv_heads * head_dim * bytes. Layouts under TP=N:
  "head" (KV split by head; replicated when there are fewer KV heads than ranks, as every engine
  does for MQA) and "batch" (Pope et al., injection.kv_shard: each rank keeps all KV heads of
  ceil(B/N) sequences).
- Communication: two all-reduces of the activations per layer (ring: 2(N-1)/N of the bytes over
  one direction of the link); "batch" adds two all-to-alls per layer (queries in, outputs back).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from plugins.core.config import (CONFIGS_DIR, KV_LAYOUTS, ConfigError, arch, head_dim, kv_heads, load_model_config,
                                 read_yaml)

HARDWARE_DIR = CONFIGS_DIR / "hardware"


@dataclass(frozen=True)
class Hardware:
    name: str
    mem_bw: float       # bytes/s one device reads from its memory
    peak_flops: float   # FLOP/s of one device in the dtype used (dense bf16 for GPUs)
    mem_bytes: float    # memory of one device
    link_bw: float      # bytes/s one device sends in one direction (NVLink / shared memory)
    note: str = ""

    def __post_init__(self):
        for key in ("mem_bw", "peak_flops", "mem_bytes", "link_bw"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"hardware {self.name!r}: {key} must be a positive number, got {value!r}")

    def split(self, n: int) -> "Hardware":
        """N ranks on one host (this CPU): each gets 1/N of its bandwidth, FLOP/s and memory."""
        return Hardware(f"{self.name}/{n}", self.mem_bw / n, self.peak_flops / n, self.mem_bytes / n,
                        self.link_bw / n, self.note)


_HW_KEYS = {"mem_bw", "peak_flops", "mem_bytes", "link_bw", "note"}


def hardware_names() -> list[str]:
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))


def read_hardware_spec(name: str) -> dict:
    """The raw spec; a value `measured` means "probe this machine" (see scripts/compare.py)."""
    path = HARDWARE_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown hardware {name!r}; known: {', '.join(hardware_names())}")
    raw = read_yaml(path)
    unknown = sorted(set(raw) - _HW_KEYS)
    missing = sorted(_HW_KEYS - {"note"} - set(raw))
    if unknown or missing:
        raise ConfigError(f"{path.name}: unknown key(s) {unknown}, missing key(s) {missing}; "
                          f"allowed: {', '.join(sorted(_HW_KEYS))}")
    return raw


def load_hardware(name: str, measured: dict | None = None) -> Hardware:
    """A hardware spec by name; `measured` fills the values a spec marks `measured`."""
    raw = read_hardware_spec(name)
    for key, value in raw.items():
        if value == "measured":
            if not measured or key not in measured:
                raise ConfigError(f"hardware {name!r}: {key} is measured on this machine; pass it in `measured`")
            raw[key] = measured[key]
        elif key != "note" and isinstance(value, str):  # YAML 1.1 reads 3.35e12 (no sign) as a string
            try:
                raw[key] = float(value)
            except ValueError:
                raise ConfigError(f"hardware {name!r}: {key} must be a number or 'measured', got {value!r}") from None
    return Hardware(name=name, **raw)


@dataclass(frozen=True)
class Shape:
    n_layer: int
    n_embd: int
    n_head: int
    kv_heads: int
    head_dim: int
    n_inner: int
    vocab: int
    n_positions: int

    learned_positions: bool = True  # gpt_bigcode's position table; StarCoder2's RoPE has none

    @classmethod
    def from_config(cls, config) -> "Shape":
        a = arch(config)
        return cls(a.n_layer, a.hidden, a.n_head, kv_heads(config), head_dim(config), a.inner, a.vocab_size,
                   a.n_positions, not a.rope)

    def kv_heads_per_rank(self, tp: int) -> int:
        return math.ceil(self.kv_heads / tp)


def _check_layout(layout: str) -> None:
    if layout not in KV_LAYOUTS:
        raise ConfigError(f"unknown KV layout {layout!r}; use one of {', '.join(KV_LAYOUTS)}")


def layer_matmul_params(s: Shape, tp: int = 1) -> int:
    """Weights of one layer's matmuls on one rank: Q, K/V, output projection, the two MLP matrices."""
    e, kv = s.n_embd, s.head_dim * s.kv_heads_per_rank(tp)
    return e * e // tp + e * 2 * kv + e * e // tp + 2 * e * s.n_inner // tp


def layer_other_params(s: Shape) -> int:
    """Biases and layer norms of one layer (replicated; under 0.1 % of the weights)."""
    e = s.n_embd
    return (e + 2 * s.head_dim * s.kv_heads) + e + s.n_inner + e + 4 * e


def param_count(s: Shape, tp: int = 1) -> int:
    """Parameters held by one rank (tied lm_head counted once), all of them at tp=1."""
    layers = s.n_layer * (layer_matmul_params(s, tp) + layer_other_params(s))
    return layers + s.vocab * s.n_embd // tp + s.n_positions * s.n_embd * s.learned_positions + 2 * s.n_embd


def weight_bytes(s: Shape, dtype_bytes: int, tp: int = 1) -> int:
    return param_count(s, tp) * dtype_bytes


def decode_weight_bytes(s: Shape, dtype_bytes: int, tp: int = 1) -> int:
    """Weights one decode step reads: all but the position table (one row per sequence)."""
    return (param_count(s, tp) - s.n_positions * s.n_embd * s.learned_positions) * dtype_bytes


def kv_bytes(s: Shape, batch: int, seq: int, dtype_bytes: int, tp: int = 1, layout: str = "head") -> int:
    """KV cache bytes one rank holds for `batch` sequences of `seq` tokens."""
    _check_layout(layout)
    if layout == "batch":
        return 2 * s.n_layer * math.ceil(batch / tp) * seq * s.kv_heads * s.head_dim * dtype_bytes
    return 2 * s.n_layer * batch * seq * s.kv_heads_per_rank(tp) * s.head_dim * dtype_bytes


def decode_flops(s: Shape, batch: int, context: int, tp: int = 1, layout: str = "head") -> float:
    """FLOPs of one decode step on one rank, each query attending to `context` keys."""
    _check_layout(layout)
    matmul = s.n_layer * layer_matmul_params(s, tp) + s.vocab * s.n_embd // tp
    attn_batch = math.ceil(batch / tp) if layout == "batch" else batch
    attn_width = s.n_embd if layout == "batch" else s.n_embd / tp
    return 2.0 * batch * matmul + 4.0 * s.n_layer * attn_batch * attn_width * context


def prefill_flops(s: Shape, batch: int, prompt: int, tp: int = 1, layout: str = "head") -> float:
    """FLOPs of the prompt forward on one rank (causal attention; lm_head on the last position)."""
    _check_layout(layout)
    matmul = s.n_layer * layer_matmul_params(s, tp)
    attn_batch = math.ceil(batch / tp) if layout == "batch" else batch
    attn_width = s.n_embd if layout == "batch" else s.n_embd / tp
    pairs = prompt * (prompt + 1) / 2
    return 2.0 * batch * prompt * matmul + 2.0 * batch * s.vocab * s.n_embd / tp \
        + 4.0 * s.n_layer * attn_batch * attn_width * pairs


def comm_seconds(s: Shape, tokens: int, dtype_bytes: int, tp: int, link_bw: float, layout: str = "head") -> float:
    """Per-rank TP communication of one forward over `tokens` (= batch x new positions)."""
    if tp == 1:
        return 0.0
    activation = tokens * s.n_embd * dtype_bytes
    seconds = 2 * s.n_layer * 2 * (tp - 1) / tp * activation / link_bw
    if layout == "batch":  # all-to-all of the rank's query / output shard, twice per layer
        seconds += 2 * s.n_layer * (tp - 1) / tp * activation / tp / link_bw
    return seconds


@dataclass(frozen=True)
class Estimate:
    memory_s: float
    compute_s: float
    comm_s: float
    bytes: float   # per rank
    flops: float   # per rank

    @property
    def total_s(self) -> float:
        return max(self.memory_s, self.compute_s) + self.comm_s

    @property
    def bound(self) -> str:
        return "memory" if self.memory_s >= self.compute_s else "compute"

    def mbu(self, seconds: float, hw: Hardware) -> float:
        """Fraction of the memory bandwidth a step that took `seconds` used."""
        return self.bytes / seconds / hw.mem_bw

    def mfu(self, seconds: float, hw: Hardware) -> float:
        return self.flops / seconds / hw.peak_flops


def decode_estimate(s: Shape, hw: Hardware, batch: int, context: int, dtype_bytes: int, tp: int = 1,
                    layout: str = "head") -> Estimate:
    """One decode step: read the rank's weights and its KV cache of `context` tokens."""
    nbytes = decode_weight_bytes(s, dtype_bytes, tp) + kv_bytes(s, batch, context, dtype_bytes, tp, layout)
    flops = decode_flops(s, batch, context, tp, layout)
    return Estimate(nbytes / hw.mem_bw, flops / hw.peak_flops,
                    comm_seconds(s, batch, dtype_bytes, tp, hw.link_bw, layout), nbytes, flops)


def prefill_estimate(s: Shape, hw: Hardware, batch: int, prompt: int, dtype_bytes: int, tp: int = 1,
                     layout: str = "head") -> Estimate:
    """The prompt forward: read the rank's weights once, write its KV cache."""
    nbytes = decode_weight_bytes(s, dtype_bytes, tp) + kv_bytes(s, batch, prompt, dtype_bytes, tp, layout)
    flops = prefill_flops(s, batch, prompt, tp, layout)
    return Estimate(nbytes / hw.mem_bw, flops / hw.peak_flops,
                    comm_seconds(s, batch * prompt, dtype_bytes, tp, hw.link_bw, layout), nbytes, flops)


def max_kv_tokens(s: Shape, hw: Hardware, dtype_bytes: int, tp: int = 1, layout: str = "head") -> int:
    """Sequences x tokens of KV cache the whole TP group can hold beside the weights."""
    free = hw.mem_bytes - weight_bytes(s, dtype_bytes, tp)
    if free <= 0:
        return 0
    if layout == "batch":  # a rank holds whole sequences (every KV head) of 1/N of the batch
        return tp * int(free // kv_bytes(s, 1, 1, dtype_bytes, 1, "head"))
    return int(free // kv_bytes(s, 1, 1, dtype_bytes, tp, "head"))


def max_batch(s: Shape, hw: Hardware, context: int, dtype_bytes: int, tp: int = 1, layout: str = "head") -> int:
    """Largest batch whose weights + KV cache of `context` tokens per sequence fit on every rank."""
    free = hw.mem_bytes - weight_bytes(s, dtype_bytes, tp)
    if free <= 0:
        return 0
    if layout == "batch":  # each rank holds ceil(B/N) whole sequences
        return tp * int(free // kv_bytes(s, 1, context, dtype_bytes, 1, "head"))
    return int(free // kv_bytes(s, 1, context, dtype_bytes, tp, layout))


def project(model_names, hw: Hardware, context: int, batches, dtype_bytes: int = 2, tps=(1, 2, 4, 8)) -> list[dict]:
    """Predicted latency / MFU / capacity for each model, MQA and MHA, TP sizes and KV layouts."""
    rows = []
    for name in model_names:
        for multi_query in (True, False):
            s = Shape.from_config(load_model_config(name, multi_query=multi_query))
            for tp in (t for t in tps if s.n_head % t == 0):
                for layout in ("head", "batch") if (multi_query and tp > 1) else ("head",):
                    fit = max_batch(s, hw, context, dtype_bytes, tp, layout)
                    row = {"model": name, "hardware": hw.name, "attention": "MQA" if multi_query else "MHA",
                           "tp": tp, "kv_layout": layout, "context": context, "dtype_bytes": dtype_bytes,
                           "weight_bytes_per_rank": weight_bytes(s, dtype_bytes, tp), "max_batch": fit,
                           "max_kv_tokens": max_kv_tokens(s, hw, dtype_bytes, tp, layout),
                           "prefill_ms": 1e3 * prefill_estimate(s, hw, 1, context, dtype_bytes, tp, layout).total_s,
                           "decode": {}}
                    for b in batches:
                        est = decode_estimate(s, hw, b, context, dtype_bytes, tp, layout)
                        row["decode"][b] = {"ms": 1e3 * est.total_s, "mfu_pct": 100.0 * est.mfu(est.total_s, hw),
                                            "bound": est.bound, "fits": b <= fit,
                                            "kv_bytes_per_rank": kv_bytes(s, b, context, dtype_bytes, tp, layout)}
                    rows.append(row)
    return rows

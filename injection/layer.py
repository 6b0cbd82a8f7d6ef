"""The DeepSpeed inference layer that replaces `GPTBigCodeBlock`, and its op bindings.

DeepSpeed's op bindings (`ops/transformer/inference/op_binding/*.py`) bind a compiled kernel
when one exists and their pure-torch `*_fallback` otherwise. On CPU there is no compiled
inference op, so the fallbacks are the kernels; we subclass the bindings and supply fallbacks
that are right for gpt_bigcode (tanh GELU, MQA attention on a one-head cache) and fast:

- linear layers: on CPU the weights are stored [out, in] (nn.Linear's layout) under DeepSpeed's
  [in, out] parameter names, and `plugins.kernels.linear` runs what the CPU's probe picked for
  this many rows: our kernels (bf16 on weights packed once per layer), oneDNN-packed bf16,
  or fp32 where bf16 has no fast GEMM; GELU fused into the first MLP GEMM. fp32 uses `F.linear`
  (bit-for-bit HF's GEMM).
- weight-only int8 / int4 (`quantize`, the backend's `quantize="int8" | "int4"`): DeepSpeed's own
  int8 convention (an int8 weight tensor carrying `.scale`), computed by `plugins.kernels.quant`:
  our kernel on CPU (AVX512: any rows; AVX2: one row), torch's `aten._weight_int8pack_mm` otherwise; int4
  as the packed uint8 tensor of a `plugins.kernels.quant.Int4Weight` (our AVX512 kernel's pack, or
  torch's for its CPU int4 kernel), carrying it as `.int4`.
- attention: the fused c_attn output is sliced, never copied; prompts run SDPA's grouped-query
  attention on the one KV head (no repeat / expand of K or V), plainly causal for a whole prompt; a
  bf16 one-token step on an MQA cache runs our decode kernel where the rung has it (AVX512). Inside
  `plugins.kernels.rows_alone()` several tokens are attended one by one, as one-token steps.
- layer norms and residual adds (bf16, CPU, a compiled rung): fused kernels (`plugins.kernels.layer_ops`)
  in place of torch's layer norm and DeepSpeed's residual fallback (which widens five operands to fp32).
- a bf16 one-token step of an MQA layer on CPU makes the same kernel calls without the bindings' module
  calls (`injection.one_token`).

With CUDA, DeepSpeed binds its compiled kernels for the GEMMs, layer norms and the fused
bias-GELU MLP (tanh GELU in the kernel); attention always runs on our cache (DeepSpeed's
softmax_context kernel keeps its own KV workspace expanded to all heads).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from deepspeed import comm as dist
from deepspeed.comm import pg_utils
from deepspeed.model_implementations.transformers.ds_transformer import DeepSpeedTransformerInference
from deepspeed.ops.transformer.inference.op_binding import (MLPGemmOp, QKVGemmOp, ResidualAddOp, SoftmaxContextOp,
                                                            VectorMatMulOp)
from torch import nn

from injection import compat
from injection.one_token import OneTokenStep
from plugins import kernels
from plugins.engine.kv_cache import SegmentLayer, layer_cache
from plugins.kernels import PackedWeights, layer_ops
from plugins.kernels.quant import int4_linear, int8_linear, quantize_int4, quantize_per_channel


def linear(x, weight, bias, packs: PackedWeights, gelu: bool = False):
    """x @ weight (+ bias) (then tanh GELU), weight stored [in, out] as DeepSpeed keeps it; an int8
    weight (from `quantize`) is stored [out, in] with its per-row `.scale`, as torch's kernel wants; an
    int4 weight is a uint8 pack carrying its Int4Weight."""
    if weight.dtype == torch.int8:
        return int8_linear(x, weight, weight.scale, bias, gelu, packs)
    if weight.dtype == torch.uint8:
        return int4_linear(x, weight.int4, bias, gelu)
    return kernels.linear(x, weight.t(), bias, gelu, packs)


def prepack(model, impls) -> None:
    """Pack every injected layer's bf16 weights for `impls` (plugins.kernels.packed_bf16_impls()) as their
    first forward at each row count would, keyed as `linear` asks: a server's first long prompt would
    otherwise wait for it (docs/kernels.md)."""
    for block in model.modules():
        if not isinstance(block, DeepSpeedGPTBigCodeInference):
            continue
        if not block.weights_row_major:
            block.store_row_major()  # the storage the forward will read (packs are keyed by it)
        attn, mlp = block.attention, block.mlp
        for op, weight in ((attn.qkv_func, attn.attn_qkvw), (attn.vector_matmul_func, attn.attn_ow),
                           (mlp.mlp_gemm_func, mlp.inter_w), (mlp.mlp_gemm_func, mlp.output_w)):
            if hasattr(op, "packs") and weight is not None and weight.dtype == torch.bfloat16:
                op.packs.prepack(weight.t(), impls)


class GPTBigCodeQKVGemmOp(QKVGemmOp):
    """ln_1 + the fused c_attn GEMM ([Q|K|V] for MQA, per-head [q,k,v] for MHA, used as stored)."""

    def __init__(self, config):
        super().__init__(config)
        self.packs = PackedWeights()

    def qkv_gemm_fallback(self, input, weight, q_scale, bias, gamma, beta, eps, add_bias, q_int8, transpose):
        fused = layer_ops.add_layer_norm(input, gamma, beta, eps)
        inp_norm = fused[1] if fused is not None else F.layer_norm(input, (input.shape[-1], ), gamma, beta, eps)
        return [linear(inp_norm, weight, bias if add_bias else None, self.packs), inp_norm]


class GPTBigCodeVectorMatMulOp(VectorMatMulOp):

    def __init__(self, config):
        super().__init__(config)
        self.packs = PackedWeights()

    def vector_matmul_fallback(self, input, weight, async_op, q_scale, q_int8, transpose):
        return linear(input, weight, None, self.packs)


class GPTBigCodeMLPGemmOp(MLPGemmOp):
    """Upstream's fallback uses erf GELU; gpt_bigcode's `gelu_pytorch_tanh` is the tanh form."""

    def __init__(self, config):
        super().__init__(config)
        self.packs = PackedWeights()

    def mlp_gemm_fallback(self, input, residual, input_bias, weight_interm, weight_out, bias, gamma, beta, eps,
                          pre_layer_norm, mlp_after_attn, interm_scale, out_scale, dtype, mlp_act_func_type,
                          transpose):
        # Same contract as upstream: ln_2(attn + residual + attn bias) -> c_fc -> GELU -> c_proj (no bias).
        fused = layer_ops.add_layer_norm(residual, gamma, beta, eps, input, input_bias)
        if fused is not None:
            ln_out = fused[1]
        else:
            ln_out = F.layer_norm(input + residual + input_bias, (input.shape[-1], ), gamma, beta, eps)
        hidden = linear(ln_out, weight_interm, bias, self.packs, gelu=True)
        return linear(hidden, weight_out, None, self.packs), ln_out


class GPTBigCodeResidualAddOp(ResidualAddOp):
    """Upstream's fallback converts all five operands to fp32 (~12 ops per layer); on CPU bf16 without
    TP one fused kernel does the same sums: residual + attn + attn bias + c_proj bias + mlp output."""

    def residual_add_fallback(self, hidden_state, residual, attention_output, attention_bias, final_bias, mp_size,
                              mlp_after_attn, add_bias, pre_layer_norm):
        if (mp_size == 1 and mlp_after_attn and pre_layer_norm
                and layer_ops.add_residuals_(residual, attention_output, attention_bias, hidden_state, final_bias)):
            return residual
        return ResidualAddOp.residual_add_fallback(hidden_state, residual, attention_output, attention_bias, final_bias,
                                                   mp_size, mlp_after_attn, add_bias, pre_layer_norm)


class MQASoftmaxContextOp(SoftmaxContextOp):
    """Attention on the fused QKV output with a preallocated cache of `kv_heads` heads.

    Layout of the fused projection: `per_head_qkv` (gpt_bigcode MHA: per head [q, k, v]), else
    [Q (heads*d) | K (kv_heads*d) | V (kv_heads*d)] (MQA, and injection.starcoder2's GQA). Queries, keys
    and values are views of it; keys and values are cached with their `kv_heads` heads, never repeated.
    Several tokens: SDPA with grouped-query attention (each KV head serves its group of query heads), the
    mask [B or 1, 1, T, L] broadcast over the heads, plainly causal (no mask built) for a whole prompt.
    One token: each KV head's query heads stacked as its query rows, our decode kernel for MQA where the
    rung has it. `window`: a sliding window (None: none) applied where the op builds the causal mask
    itself; a mask handed in is complete (HF's and our decoders' masks carry the window).
    """

    window: int | None = None
    per_head_qkv = True  # gpt_bigcode: MHA's c_attn is per head [q, k, v]

    def split(self, qkv, heads: int, kv_heads: int, head_dim: int):
        """Views (query [B, heads, T, d], key, value [B, kv_heads, T, d]) of the fused projection."""
        batch, q_len, _ = qkv.shape
        if kv_heads == heads and self.per_head_qkv:
            query, key, value = qkv.view(batch, q_len, heads, 3 * head_dim).transpose(1, 2).split(head_dim, dim=-1)
            return query, key, value
        q_end, kv_width = heads * head_dim, kv_heads * head_dim
        query = qkv[..., :q_end].view(batch, q_len, heads, head_dim).transpose(1, 2)
        key = qkv[..., q_end:q_end + kv_width].view(batch, q_len, kv_heads, head_dim).transpose(1, 2)
        value = qkv[..., q_end + kv_width:q_end + 2 * kv_width].view(batch, q_len, kv_heads, head_dim).transpose(1, 2)
        return query, key, value

    def forward(self, qkv, mask, kv, heads: int, kv_heads: int, scale: float):
        if isinstance(kv, SegmentLayer):
            return self._segments(qkv, mask, kv, heads, kv_heads, scale)
        batch, q_len, _ = qkv.shape
        if q_len > 1 and kv is not None and kernels.rows_alone_active():
            # Each query row exactly as a one-token step computes it: appended to the cache on its own,
            # attending over the keys up to itself with its row of the mask ([B, 1, 1 or q_len, L]).
            start = kv.length
            rows = [self.forward(qkv[:, t:t + 1], _row_mask(mask, t, q_len, start), kv, heads, kv_heads, scale)
                    for t in range(q_len)]
            return torch.cat(rows, 1)
        head_dim = self.config.hidden_size // self.config.heads
        query, key, value = self.split(qkv, heads, kv_heads, head_dim)
        if kv is not None:
            key, value = kv.update(key, value)
        length = key.shape[2]
        if q_len == 1:
            query = query.reshape(batch, kv_heads, heads // kv_heads, head_dim)  # a group's heads as query rows
            mask = _causal_mask(mask, 1, length, qkv.device, self.window)
            out = _decode_attention(query, key, value, mask, scale) if kv_heads == 1 else None
            if out is None:
                out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
            return out.reshape(batch, 1, heads * head_dim)
        causal = mask is None and q_len == length and (self.window is None or length <= self.window)
        if not causal:
            mask = _causal_mask(mask, q_len, length, qkv.device, self.window)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=causal, scale=scale,
                                             enable_gqa=kv_heads != heads)
        return out.transpose(1, 2).reshape(batch, q_len, heads * head_dim)

    def _segments(self, qkv, mask, kv: SegmentLayer, heads: int, kv_heads: int, scale: float):
        """qkv [1, rows + chunk tokens, ..]: the pool rows' one-token steps (`mask` is theirs), then each
        prompt chunk causally over its own cache (the chunks before it already there)."""
        n = kv.rows
        parts = []
        if n:  # no rows: prompt chunks alone
            parts.append(self.forward(qkv[0, :n].unsqueeze(1), mask, kv.pool, heads, kv_heads, scale).view(1, n, -1))
        start = n
        for i, (layer, length) in enumerate(kv.chunks):
            kv.start(i)
            parts.append(self.forward(qkv[:, start:start + length], None, layer, heads, kv_heads, scale))
            start += length
        return torch.cat(parts, 1)


def _decode_attention(query, key, value, mask, scale: float):
    """One token per sequence on the one-head cache with our kernel (query [B, 1, heads, d], key /
    value [B, 1, L, d], mask None or [B or 1, 1, 1, L] bool); None where it does not apply."""
    batch, length = key.shape[0], key.shape[2]
    if mask is not None:
        if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[-1] != length or mask.shape[2] != 1:
            return None
        mask = mask.expand(batch, 1, 1, length)[:, 0, 0]
    return layer_ops.mqa_decode_attention(query[:, 0], key[:, 0], value[:, 0], mask, scale)


def _causal_mask(mask, q_len: int, kv_len: int, device, window: int | None = None):
    """HF passes a 4-D mask, or None when attention is plainly causal (no padding): then the causal mask,
    within the sliding window where there is one (the last q_len of kv_len keys are the queries)."""
    if mask is not None:
        return mask
    if q_len == 1 and (window is None or kv_len <= window):
        return None
    causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)
    if window is not None:
        causal = causal.triu(kv_len - q_len - window + 1)
    return causal[None, None]


def _row_mask(mask, t: int, q_len: int, start: int):
    """Query row t's mask over the keys up to itself: a [B, 1, 1, L] padding mask's columns, or row t of a
    [B, 1, q_len, L] one (causal and windowed by its maker)."""
    if mask is None:
        return None
    if mask.shape[2] == q_len:
        mask = mask[:, :, t:t + 1]
    return mask[..., :start + t + 1]


class DeepSpeedGPTBigCodeInference(DeepSpeedTransformerInference):
    """DeepSpeed's inference layer, called the way transformers 5.x calls `GPTBigCodeBlock`:
    `(hidden_states, encoder_hidden_states, layer_past=<Cache>, attention_mask=<4-D mask>, ...)`,
    returning the hidden states tensor."""

    context_op = MQASoftmaxContextOp  # the attention op (injection.starcoder2's for GQA)

    def __init__(self, config, mp_group=None, layer_idx: int = 0, kv_heads: int = 1, max_positions: int = 2048,
                 scale: float = 1.0):
        with compat.cpu_op_fallbacks(), compat.quiet_workspace_fallback():
            super().__init__(config, mp_group)
            attn, mlp = self.attention, self.mlp
            attn.qkv_func = GPTBigCodeQKVGemmOp(config)
            attn.vector_matmul_func = GPTBigCodeVectorMatMulOp(config)
            attn.score_context_func = self.context_op(config)
            mlp.mlp_gemm_func = GPTBigCodeMLPGemmOp(config)
            mlp.residual_add_func = GPTBigCodeResidualAddOp(config)
        self.layer_idx = layer_idx      # HF's index into the Cache (DeepSpeed's layer_id is a global counter)
        self.kv_heads = kv_heads        # per rank: 1 for MQA (replicated), heads / tp for MHA
        self.kv_capacity = min(config.max_out_tokens, max_positions)
        self.scale = scale
        self.weights_row_major = False
        self._one_token = (None, None)  # (linear choice, its OneTokenStep or None), made at the first decode step
        if compat.on_cpu():
            kernels.decision()  # kernels built (once per machine) now, not inside the first decode step
            layer_ops.amx_module()

    def _linear_weights(self):
        attn, mlp = self.attention, self.mlp
        return ((attn, "attn_qkvw"), (attn, "attn_ow"), (mlp, "inter_w"), (mlp, "output_w"))

    def store_row_major(self) -> None:
        """CPU: keep each linear weight [in, out] as DeepSpeed names it, stored [out, in] (so `.t()` is
        contiguous for our kernel and oneDNN's packing, without a second copy). DeepSpeed's CUDA kernels
        read the [in, out] storage, so this is CPU only. Runs once, at the first forward (after
        DeepSpeed has copied the weights in)."""
        for owner, name in self._linear_weights():
            param = getattr(owner, name)
            if param.is_floating_point() and not param.t().is_contiguous():
                param.data = param.data.t().contiguous().t()
        self.weights_row_major = True
        self._one_token = (None, None)

    def quantize(self, kind: str = "int8") -> None:
        """Weight-only quantization of the four linears (in place): "int8" (per-output-channel symmetric
        scales) or "int4" (groups of input channels, CPU only). The bf16/fp32 weights are dropped;
        biases, layer norms and activations keep their dtype."""
        attn, mlp = self.attention, self.mlp
        for owner, name in self._linear_weights():
            weight = getattr(owner, name)
            if kind == "int8":
                q, scales = quantize_per_channel(weight.t())  # [in, out] -> int8 [out, in]
                param = nn.Parameter(q, requires_grad=False)
                param.scale = scales.to(weight.dtype)  # DeepSpeed's op bindings read `weight.scale` as q_scale
            else:
                int4 = quantize_int4(weight.t(), weight.dtype)
                param = nn.Parameter(int4.packed, requires_grad=False)
                param.int4 = int4
            setattr(owner, name, param)
        self._one_token = (None, None)
        # DeepSpeed's compiled kernels (CUDA) expect their own int8 format: route these linears to our fallbacks.
        attn.qkv_func.qkv_gemm_func = attn.qkv_func.qkv_gemm_fallback
        attn.vector_matmul_func.vector_matmul_func = attn.vector_matmul_func.vector_matmul_fallback
        mlp.mlp_gemm_func.mlp_gemm_func = mlp.mlp_gemm_func.mlp_gemm_fallback

    def one_token_step(self, impl: str) -> OneTokenStep | None:
        """The direct one-token step for linear choice `impl`, None where this layer does not fit it
        (MHA, quantized or TP weights, no fused kernels on this rung)."""
        if self._one_token[0] != impl:
            self._one_token = (impl, OneTokenStep(self, impl) if OneTokenStep.fits(self) else None)
        return self._one_token[1]

    def forward(self, hidden_states=None, encoder_hidden_states=None, layer_past=None, attention_mask=None,
                use_cache=False, **kwargs):
        if encoder_hidden_states is not None:
            raise NotImplementedError("gpt_bigcode cross-attention is not supported by the injected layer")
        return self.block(hidden_states, layer_past, attention_mask)

    def block(self, hidden_states, cache, attention_mask, rope=None):
        """The layer on `cache` (a transformers Cache, Segments or None); `rope(qkv)` rotates the fused
        projection's queries and keys before they are cached (StarCoder2), None for none."""
        if not self.weights_row_major and hidden_states.device.type == "cpu":
            self.store_row_major()
        kv = layer_cache(cache, self.layer_idx, self.kv_capacity)
        if rope is None and OneTokenStep.takes(hidden_states, kv, attention_mask):
            step = self.one_token_step(kernels.bf16_choice(hidden_states))
            if step is not None:
                return step(hidden_states, kv, attention_mask)
        input_dtype = hidden_states.dtype
        x = hidden_states.to(self.config.dtype)
        self.allocate_workspace(x.size())  # as upstream: the compiled kernels' scratch space (CPU: sizes only)
        attn = self.attention
        with torch.no_grad():
            qkv, inp_norm = attn.qkv_func(input=x, weight=attn.attn_qkvw, bias=attn.attn_qkvb, gamma=self.norm_w,
                                          beta=self.norm_b)
            if rope is not None:
                qkv = rope(qkv)
            context = attn.score_context_func(qkv, attention_mask, kv, attn.num_attention_heads_per_partition,
                                              self.kv_heads, self.scale)
            out = attn.vector_matmul_func(input=context, weight=attn.attn_ow)
            if pg_utils.is_parallel(attn.mp_group):
                dist.all_reduce(out, group=attn.mp_group)
            out = self.mlp(out, x, inp_norm, attn.attn_ob)  # adds both residuals and biases
        return out.to(input_dtype)

"""DeepSpeed-Inference with our gpt_bigcode kernel-injection policy (`injection/`), as a Backend.

The HF model is loaded, `injection.register()` plugs the policy in, and
`deepspeed.init_inference(..., replace_with_kernel_inject=True)` replaces every GPTBigCodeBlock.
The injected model is still an HF causal LM, so `HFDecoder` drives it, on a `SingleHeadCache`
sized exactly for what is cached: prompt + new tokens - 1.

tp_size > 1: called in a plain process, `from_hf` starts the ranks itself (plugins.launcher,
torchrun or `deepspeed --num_accelerators N`) and returns a RemoteBackend; inside a rank (torch
distributed initialised with world size N), it injects with `tensor_parallel={"tp_size": N}`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .backend import ConfigError, GenerationResult, check_inputs, check_load, position_ids, resolve_dtype
from .checkpoint import load_hf_model, read_hf_config
from .generation import Sampler, generate
from .hf import HFDecoder


class DeepSpeedBackend:
    name = "deepspeed"

    def __init__(self, engine, dtype: torch.dtype, device: str = "cpu", tp_size: int = 1):
        self.engine = engine
        self.model = engine.module
        self.config = self.model.config
        self.dtype = dtype
        self.device = device
        self.tp_size = tp_size

    @classmethod
    def from_hf(cls, hf_dir: str | Path, dtype="float32", tp_size: int = 1, device: str | None = None,
                max_out_tokens: int | None = None, launcher: str = "torchrun"):
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        resolved = resolve_dtype(dtype, device)
        config = read_hf_config(hf_dir)
        check_load(config, tp_size)  # before any rank starts or reads weights
        dist = torch.distributed
        if tp_size > 1 and not (dist.is_initialized() and dist.get_world_size() == tp_size):  # not in a rank
            from .launcher import RemoteBackend

            return RemoteBackend(cls.name, hf_dir, dtype=dtype, tp_size=tp_size, launcher=launcher,
                                 max_out_tokens=max_out_tokens)
        if tp_size > 1 and device == "cpu" and "LOCAL_SIZE" not in os.environ:
            raise ConfigError("DeepSpeed TP on CPU needs LOCAL_SIZE (ranks on this machine): launch with "
                              f"`LOCAL_SIZE={tp_size} torchrun --nproc_per_node {tp_size} ...` or "
                              f"`deepspeed --num_accelerators {tp_size} ...`; without it DeepSpeed's "
                              "shared-memory all-reduce segfaults")
        engine = cls._engine(load_hf_model(hf_dir, resolved), resolved, tp_size, max_out_tokens or config.n_positions)
        return cls(engine, resolved, device, tp_size)

    @staticmethod
    def _engine(model, dtype, tp_size, max_out_tokens):
        import deepspeed
        import injection

        injection.register()
        return deepspeed.init_inference(model, dtype=dtype, replace_with_kernel_inject=True,
                                        tensor_parallel={"tp_size": tp_size}, max_out_tokens=max_out_tokens)

    def _layer0(self):
        """Layer 0's weights as DeepSpeed stores them: [in, out]."""
        layer = self.model.transformer.h[0]
        attn, mlp = layer.attention, layer.mlp
        return {"attn_qkvw": attn.attn_qkvw, "attn_ow": attn.attn_ow, "inter_w": mlp.inter_w, "output_w": mlp.output_w}

    def shard_info(self) -> list[dict]:
        """Every rank's layer-0 parameter shapes and its c_attn columns (gathered, rank order)."""
        weights = self._layer0()
        info = {name: tuple(t.shape) for name, t in weights.items()}
        info["qkv_cols"] = weights["attn_qkvw"].float().cpu()
        info["kv_cols"] = info["qkv_cols"][:, -2 * self.config.n_embd // self.config.n_head:]
        if self.tp_size == 1:
            return [info]
        out = [None] * self.tp_size
        torch.distributed.all_gather_object(out, info)
        return out

    def _prepare(self, input_ids, attention_mask, max_new_tokens=0):
        check_inputs(self.config, input_ids, attention_mask, max_new_tokens)
        return input_ids.to(self.device), attention_mask.to(self.device)

    @torch.inference_mode()
    def logits(self, input_ids, attention_mask):
        input_ids, attention_mask = self._prepare(input_ids, attention_mask)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids(attention_mask), use_cache=False)
        return out.logits.float().cpu()

    def decoder(self, batch: int, max_length: int) -> HFDecoder:
        from injection import SingleHeadCache

        cache = SingleHeadCache(self.config, max_length, batch=batch, dtype=self.dtype, device=self.device,
                                tp_size=self.tp_size)
        return HFDecoder(self.model, cache)

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


class AutoTPBackend(DeepSpeedBackend):
    """DeepSpeed AutoTP (no kernel injection) with balanced MQA shards: injection.autotp."""

    name = "deepspeed-autotp"

    @staticmethod
    def _engine(model, dtype, tp_size, max_out_tokens):
        from injection.autotp import init_autotp

        return init_autotp(model, tp_size, dtype)

    def _layer0(self):
        block = self.model.transformer.h[0]
        return {"attn_qkvw": block.attn.c_attn.weight.t(), "attn_ow": block.attn.c_proj.weight.t(),
                "inter_w": block.mlp.c_fc.weight.t(), "output_w": block.mlp.c_proj.weight.t()}

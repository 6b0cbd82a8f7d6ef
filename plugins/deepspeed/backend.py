"""DeepSpeed-Inference with our gpt_bigcode kernel-injection policy (`injection/`), as a Backend.

The HF model is loaded, `injection.register()` plugs the policy in, and
`deepspeed.init_inference(..., replace_with_kernel_inject=True)` replaces every GPTBigCodeBlock.
The injected model is still an HF causal LM (so logits and prefill are HF's calls), decoding on a
`SingleHeadCache` sized exactly for what is cached: prompt + new tokens - 1. At TP 1 decode steps
skip HF's model forward (`decoder.InjectedDecoder`).

Speed options (tp_size 1): `quantize="int8" | "int4"` (weight-only layer linears, int4 on CPU;
`quantize_lm_head=True` adds the LM head), `compile=True` (torch.compile of the decode step, eager if
that fails), `speculative={"k": 4, "draft": "int8" | "int4" | <HF dir> | "prompt-lookup"}` (exact greedy
speculative decoding; "int8" / "int4" draft with the target's own layers quantized, "prompt-lookup" copies
the k tokens that followed the last match of the trailing `ngram` tokens (default 2) in the prompt
and the text so far: transformers' `prompt_lookup_num_tokens`, k defaults to 10 there).

tp_size > 1: called in a plain process, `from_hf` starts the ranks itself (plugins.launch.launcher,
torchrun or `deepspeed --num_accelerators N`) and returns a RemoteBackend; inside a rank (torch
distributed initialised with world size N), it injects with `tensor_parallel={"tp_size": N}`.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch

from injection import SingleHeadCache, kv_shard
from injection.tp import check_autotp
from plugins import kernels
from plugins.core.checkpoint import load_hf_model, read_hf_config
from plugins.core.config import ConfigError, arch, head_dim, kv_heads_per_rank
from plugins.core.tensors import check_load, default_device, needs_ranks, resolve_dtype
from plugins.deepspeed.decoder import InjectedDecoder, Trunk, head_packs
from plugins.engine.backend import LocalBackend
from plugins.engine.contract import GenerationResult
from plugins.engine.hf_model import HFDecoder, HFModelBackend, PoolDecoder
from plugins.engine.speculative import ModelDraft, PromptLookupDraft, speculative_generate
from plugins.kernels.quant import QUANTIZED


class DeepSpeedBackend(HFModelBackend):
    name = "deepspeed"
    fast_decode = True  # TP 1 decode steps through InjectedDecoder (the injected layers, no HF model forward)

    def __init__(self, engine, dtype: torch.dtype, device: str = "cpu", tp_size: int = 1, kv_layout: str = "head",
                 compile: bool = False):
        super().__init__(engine.module, dtype, device, tp_size)
        self.engine = engine
        self.kv_layout = kv_layout    # "head": MQA KV replicated per rank; "batch": injection.kv_shard
        self.compile = compile
        self.speculative = None       # speculative decoding: the checked options ...
        self.draft = None             # ... and the draft model's backend (None for prompt lookup)

    @classmethod
    def from_hf(cls, hf_dir: str | Path, dtype="float32", tp_size: int = 1, device: str | None = None,
                max_out_tokens: int | None = None, launcher: str = "torchrun", kv_layout: str = "head",
                quantize: str | None = None, quantize_lm_head: bool = False, compile: bool = False,
                speculative: dict | None = None, timeout_s: float = 600.0, env: dict | None = None,
                nnodes: int = 1, rdzv_endpoint: str | None = None):
        """launcher, timeout_s, env, nnodes, rdzv_endpoint: how the ranks of tp_size > 1 are started
        (plugins.launch.launcher)."""
        device = device or default_device()
        resolved = resolve_dtype(dtype, device)
        if "int4" in (quantize, (speculative or {}).get("draft")) and device != "cpu":
            raise ConfigError("int4 runs on CPU (our kernel or torch's CPU int4 kernel); use 'int8' on CUDA")
        config = read_hf_config(hf_dir)
        check_load(config, tp_size)  # before any rank starts or reads weights
        cls.check_family(config, tp_size)
        speculative = check_speed_options(config, tp_size, quantize, quantize_lm_head, compile, speculative)
        kv_shard.check_kv_layout(kv_layout, is_mqa(config), tp_size)
        if needs_ranks(tp_size):
            from injection.compat import sweep_shm_segments
            from plugins.core.console import announce, extension_built
            from plugins.launch.launcher import RemoteBackend

            sweep_shm_segments()  # what ranks killed before they could unlink their segments left in RAM
            if device == "cpu" and not extension_built("deepspeed_shm_comm"):
                announce("first tensor-parallel run on this machine: DeepSpeed compiles its shared-memory "
                         "all-reduce (~40 s, minutes on a busy machine)...")
            return RemoteBackend(cls.name, hf_dir, dtype=dtype, tp_size=tp_size, launcher=launcher,
                                 timeout_s=timeout_s, env=env, nnodes=nnodes, rdzv_endpoint=rdzv_endpoint,
                                 max_out_tokens=max_out_tokens, kv_layout=kv_layout)
        if tp_size > 1 and device == "cpu" and "LOCAL_SIZE" not in os.environ:
            raise ConfigError("DeepSpeed TP on CPU needs LOCAL_SIZE (ranks on this machine): launch with "
                              f"`LOCAL_SIZE={tp_size} torchrun --nproc_per_node {tp_size} ...` or "
                              f"`deepspeed --num_accelerators {tp_size} ...`; without it DeepSpeed's "
                              "shared-memory all-reduce segfaults")
        model = load_hf_model(hf_dir, resolved, config=config)
        engine = cls._engine(model, resolved, tp_size, max_out_tokens or arch(config).n_positions)
        if kv_layout == "batch":
            kv_shard.shard_kv_by_batch(engine.module)
        backend = cls(engine, resolved, device, tp_size, kv_layout, compile)
        if speculative is not None:  # the draft copies the weights before anything is packed or quantized
            backend.speculative = speculative
            if speculative["draft"] in QUANTIZED:
                backend.draft = backend._quantized_copy(speculative["draft"])
            elif speculative["draft"] != "prompt-lookup":
                backend.draft = DeepSpeedBackend.from_hf(speculative["draft"], dtype=resolved, device=device,
                                                         compile=compile)
        if quantize is not None:
            quantize_model(backend.model, quantize, quantize_lm_head)
        if backend.dtype == torch.bfloat16 and backend.device == "cpu" and not compile:
            backend._prepack()
        return backend

    def _prepack(self) -> None:
        """Every bf16 weight packed now for each layout the kernel table picks at some row count, not
        by the first forward that reaches it (inductor packs for itself under `compile`)."""
        from injection import layer

        impls = kernels.packed_bf16_impls()
        layer.prepack(self.model, impls)
        head = head_packs(self.model)
        if head is not None and self.model.lm_head.weight.dtype == torch.bfloat16:
            head.prepack(self.model.lm_head.weight, impls)

    @classmethod
    def check_family(cls, config, tp_size: int = 1) -> None:
        """Kernel injection: gpt_bigcode and starcoder2 (injection.register plugs both policies), any TP that
        check_tp takes."""

    @classmethod
    def check_options(cls, config, tp_size: int, **options) -> None:
        super().check_options(config, tp_size, **options)
        cls.check_family(config, tp_size)
        check_speed_options(config, tp_size, options.get("quantize"), options.get("quantize_lm_head", False),
                            options.get("compile", False), options.get("speculative"))
        kv_shard.check_kv_layout(options.get("kv_layout", "head"), is_mqa(config), tp_size)

    @staticmethod
    def _engine(model, dtype, tp_size, max_out_tokens):
        import deepspeed

        import injection

        injection.register()
        return deepspeed.init_inference(model, dtype=dtype, replace_with_kernel_inject=True,
                                        tensor_parallel={"tp_size": tp_size}, max_out_tokens=max_out_tokens)

    def _layer0(self):
        """Layer 0's weights as DeepSpeed stores them: [in, out]."""
        layer = Trunk(self.model).layers[0]
        attn, mlp = layer.attention, layer.mlp
        return {"attn_qkvw": attn.attn_qkvw, "attn_ow": attn.attn_ow, "inter_w": mlp.inter_w, "output_w": mlp.output_w}

    def shard_info(self) -> list[dict]:
        """Every rank's layer-0 parameter shapes and its c_attn columns (gathered, rank order)."""
        weights = self._layer0()
        info = {name: tuple(t.shape) for name, t in weights.items()}
        info["qkv_cols"] = weights["attn_qkvw"].float().cpu()
        # this rank's K and V heads (the last columns of [Q | K | V]; MHA's per-head [q, k, v] has no such block)
        kv_width = 2 * kv_heads_per_rank(self.config, self.tp_size) * head_dim(self.config)
        info["kv_cols"] = info["qkv_cols"][:, -kv_width:]
        if self.tp_size == 1:
            return [info]
        out = [None] * self.tp_size
        torch.distributed.all_gather_object(out, info)
        return out

    def linear_paths(self, batch: int, prompt_len: int) -> dict:
        weight = Trunk(self.model).layers[0].attention.attn_qkvw
        if weight.dtype == torch.uint8:
            return {"decode": f"int4 {weight.int4.layout}", "prefill": f"int4 {weight.int4.layout}"}
        return kernels.paths(self.dtype, batch, prompt_len, int8=weight.dtype == torch.int8)

    def decoder(self, batch: int, max_length: int) -> HFDecoder:
        if self.kv_layout == "batch":  # each rank caches its ceil(B / tp) sequences
            batch = kv_shard.rank_batch(batch, self.tp_size)
        cache = SingleHeadCache(self.config, max_length, batch=batch, dtype=self.dtype, device=self.device,
                                tp_size=self.tp_size)
        return self._decoder_on(cache)

    def _decoder_on(self, cache) -> HFDecoder:
        if not self.fast_decode or self.tp_size > 1 or self.kv_layout == "batch":  # the fast step: TP 1 only
            return HFDecoder(self.model, cache)
        return InjectedDecoder(self.model, cache, self.compile)

    def batch_decoder(self, slots: int, capacity: int) -> PoolDecoder:
        if self.kv_layout == "batch":
            raise ConfigError("continuous batching needs kv_layout='head' (rows join and leave the pool on "
                              "every rank)")
        pool = PoolDecoder(self, slots, capacity, self._decoder_on)
        if isinstance(pool.step, InjectedDecoder):
            pool.step.padded = True  # rows start at different columns: the mask is always needed
        return pool

    def generate(self, input_ids, attention_mask, max_new_tokens, do_sample=False, temperature=1.0, top_k=0,
                 top_p=1.0, seed=0) -> GenerationResult:
        if self.speculative is None or max_new_tokens <= 1:
            return super().generate(input_ids, attention_mask, max_new_tokens, do_sample, temperature, top_k,
                                    top_p, seed)
        input_ids, attention_mask = self._prepare(input_ids, attention_mask, max_new_tokens)
        if do_sample:
            raise ConfigError("speculative decoding here is greedy only: use do_sample=False, "
                              "or load the backend without `speculative`")
        k = self.speculative["k"]
        # drafted tokens run up to k columns past the last kept one
        length = input_ids.shape[1] + max_new_tokens + k
        target = self.decoder(input_ids.shape[0], length)
        if self.draft is None:
            draft = PromptLookupDraft(self.speculative["ngram"])
        else:
            draft = ModelDraft(self.draft.decoder(input_ids.shape[0], length))
        result, stats = speculative_generate(target, draft, input_ids, attention_mask, max_new_tokens, k=k)
        result.tokens = result.tokens.cpu()
        result.stats = {"k": k, "rounds": stats.rounds, "acceptance_rate": stats.acceptance_rate,
                        "tokens_per_round": stats.tokens_per_round}
        return result

    def _quantized_copy(self, kind: str) -> DeepSpeedBackend:
        """This backend with its layer linears in `kind` (int8, int4); every other tensor is shared."""
        shared = {id(t): t for t in list(self.model.parameters()) + list(self.model.buffers())}
        model = copy.deepcopy(self.model, memo=shared)
        quantize_model(model, kind, lm_head=False)
        draft = copy.copy(self)
        draft.model, draft.draft, draft.speculative = model, None, None
        return draft


def check_speed_options(config, tp_size, quantize, quantize_lm_head, compile, speculative) -> dict | None:
    """Validate the speed options before any weights are read; returns `speculative` with defaults."""
    if quantize not in (None, *QUANTIZED):
        raise ConfigError(f"quantize must be None, 'int8' or 'int4', got {quantize!r}")
    if quantize_lm_head and quantize is None:
        raise ConfigError("quantize_lm_head needs quantize='int8' or 'int4'")
    if tp_size > 1 and (quantize or compile or speculative):
        raise ConfigError("quantize, compile and speculative are options of tp_size 1")
    if speculative is None:
        return None
    if not isinstance(speculative, dict) or set(speculative) - {"k", "draft", "ngram"}:
        raise ConfigError(f"speculative must be a mapping with keys k, draft (and ngram), got {speculative!r}")
    lookup = speculative.get("draft") == "prompt-lookup"
    if "ngram" in speculative and not lookup:
        raise ConfigError("speculative ngram is an option of draft='prompt-lookup'")
    spec = {"k": 10, "ngram": 2, **speculative} if lookup else {"k": 4, "draft": "int8", **speculative}
    for key in ("k", "ngram"):
        if key in spec and (isinstance(spec[key], bool) or not isinstance(spec[key], int) or spec[key] < 1):
            raise ConfigError(f"speculative {key} must be a positive integer, got {spec[key]!r}")
    if spec["draft"] not in (*QUANTIZED, "prompt-lookup"):
        draft = read_hf_config(spec["draft"])  # a checkpoint dir: its own clear error if it is not one
        if draft.vocab_size != config.vocab_size:
            raise ConfigError(f"draft vocab_size {draft.vocab_size} != target vocab_size {config.vocab_size}")
    return spec


def is_mqa(config) -> bool:
    """gpt_bigcode multi-query attention: what the batch-sharded KV layout (injection.kv_shard) is for."""
    return arch(config).family == "gpt_bigcode" and arch(config).kv_heads == 1


def quantize_model(model, kind: str, lm_head: bool = False) -> None:
    """Weight-only `kind` linears in every injected layer (and the LM head, untied from wte, if asked)."""
    for block in Trunk(model).layers:
        block.quantize(kind)
    if lm_head:
        model.lm_head = QUANTIZED[kind](model.lm_head)


class AutoTPBackend(DeepSpeedBackend):
    """DeepSpeed AutoTP (no kernel injection): gpt_bigcode with balanced MQA shards, StarCoder2 with its KV
    heads split over the ranks (injection.autotp)."""

    name = "deepspeed-autotp"
    fast_decode = False  # HF's own blocks: HF's forward
    linear_paths = LocalBackend.linear_paths

    @classmethod
    def check_family(cls, config, tp_size: int = 1) -> None:
        check_autotp(config, tp_size)  # before any rank starts

    @staticmethod
    def _engine(model, dtype, tp_size, max_out_tokens):
        from injection.autotp import init_autotp

        return init_autotp(model, tp_size, dtype)

    def _layer0(self):
        """Layer 0's (sharded) HF linears as [in, out]; StarCoder2's q, k, v as one [Q | K | V]."""
        if arch(self.config).family == "starcoder2":
            layer = self.model.model.layers[0]
            attn, mlp = layer.self_attn, layer.mlp
            qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).t()
            return {"attn_qkvw": qkv, "attn_ow": attn.o_proj.weight.t(), "inter_w": mlp.c_fc.weight.t(),
                    "output_w": mlp.c_proj.weight.t()}
        block = self.model.transformer.h[0]
        return {"attn_qkvw": block.attn.c_attn.weight.t(), "attn_ow": block.attn.c_proj.weight.t(),
                "inter_w": block.mlp.c_fc.weight.t(), "output_w": block.mlp.c_proj.weight.t()}

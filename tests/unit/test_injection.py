"""gpt_bigcode through deepspeed.init_inference(replace_with_kernel_inject=True).

Real DeepSpeed, real transformers. Every comparison is against the HF model with the same
weights (biases and layer norms randomised so they are exercised), on left-padded batches.
"""

import copy
import inspect

import deepspeed
import pytest
import torch
import torch.nn.functional as F
from deepspeed.model_implementations.transformers.ds_transformer import DeepSpeedTransformerInference
from deepspeed.module_inject import replace_module as ds_replace_module
from deepspeed.module_inject.containers.opt import HFOPTLayerPolicy
from deepspeed.module_inject.policy import TransformerPolicy
from deepspeed.module_inject.replace_policy import replace_policies
from deepspeed.ops.transformer.inference.config import DeepSpeedInferenceConfig
from deepspeed.ops.transformer.inference.op_binding import MLPGemmOp, QKVGemmOp
from deepspeed.ops.transformer.inference.op_binding.base import BaseOp
from transformers import GPTBigCodeConfig, OPTConfig
from transformers.models.gpt_bigcode.modeling_gpt_bigcode import GPTBigCodeBlock

import injection
from injection import SingleHeadCache, SingleHeadLayer, compat
from injection.layer import DeepSpeedGPTBigCodeInference, GPTBigCodeMLPGemmOp
from injection.policy import GPTBigCodeContainer, GPTBigCodePolicy
from injection.starcoder2 import Starcoder2Container, Starcoder2Policy
from plugins.core.checkpoint import load_hf_model
from plugins.core.tensors import position_ids
from plugins.engine.generation import generate
from plugins.engine.registry import load_backend
from plugins.engine.sampling import Sampler
from plugins.hf import HFBackend

NEW_TOKENS = 64

# (config name, overrides): MQA and MHA, several head counts / widths / depths.
SHAPES = [
    ("tiny", {}),
    ("tiny-mha", {}),
    ("tiny", {"n_embd": 96, "n_head": 6, "n_layer": 3}),
    ("tiny-mha", {"n_embd": 96, "n_head": 3, "n_layer": 1}),
    ("tiny", {"n_embd": 128, "n_head": 2, "n_layer": 2, "n_inner": 192}),
]
SHAPE_IDS = ["mqa-64x4x2", "mha-64x4x2", "mqa-96x6x3", "mha-96x3x1", "mqa-128x2x2-inner192"]


def randomise(model, seed=0):
    """Non-trivial biases and layer norms (the seeded init makes them 0 and 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.copy_(p + 0.1 * torch.randn(p.shape, generator=gen).to(p.dtype))
    return model


def hf_and_injected(hf_dir, dtype=torch.float32):
    """(HF model, DeepSpeed engine) with identical weights; the engine's model is a deep copy,
    because DeepSpeed's container transposes the original weights in place."""
    hf = randomise(load_hf_model(hf_dir, torch.float32)).to(dtype)
    injection.register()
    engine = deepspeed.init_inference(copy.deepcopy(hf), dtype=dtype, replace_with_kernel_inject=True)
    return hf, engine


@pytest.fixture(scope="module")
def models(ckpt_factory):
    made = {}

    def get(name, overrides):
        key = (name, tuple(sorted(overrides.items())))
        if key not in made:
            made[key] = hf_and_injected(ckpt_factory(name, **overrides))
        return made[key]

    return get


# --- registration and the compat patches ------------------------------------------------------

def test_register_is_idempotent_and_returns_the_policy():
    first = injection.register()
    state = (list(replace_policies), ds_replace_module.policy_to_ds_container, HFOPTLayerPolicy.__init__,
             BaseOp.inference_module)
    assert injection.register() is first is GPTBigCodePolicy
    assert (list(replace_policies), ds_replace_module.policy_to_ds_container, HFOPTLayerPolicy.__init__,
            BaseOp.inference_module) == state
    assert replace_policies.count(GPTBigCodePolicy) == 1
    assert issubclass(GPTBigCodePolicy, TransformerPolicy)


def test_upstream_policy_to_ds_container_is_still_a_closed_dict(ckpt_factory):
    injection.register()
    block = load_hf_model(ckpt_factory("tiny")).transformer.h[0]
    policy = GPTBigCodePolicy(block)
    assert compat.UPSTREAM["replace_module.policy_to_ds_container"](policy=policy) is None
    # replace_transformer_layer looks the name up in replace_module's globals: that is what we rebind
    assert "policy_to_ds_container(policy=policy" in inspect.getsource(ds_replace_module.replace_transformer_layer)
    assert ds_replace_module.policy_to_ds_container is compat._policy_to_ds_container


def test_upstream_opt_policy_still_crashes_on_gelu_pytorch_tanh_and_opt_is_unchanged():
    injection.register()
    saved = TransformerPolicy.hf_model_config
    try:
        TransformerPolicy.hf_model_config = GPTBigCodeConfig()
        with pytest.raises(ValueError, match="Unsupported activation function: gelu_pytorch_tanh"):
            compat.UPSTREAM["HFOPTLayerPolicy.__init__"](HFOPTLayerPolicy.__new__(HFOPTLayerPolicy), None)
        HFOPTLayerPolicy(None)  # patched: the throw-away instance for a gpt_bigcode model is fine
        TransformerPolicy.hf_model_config = OPTConfig(activation_function="silu")
        with pytest.raises(ValueError, match="Unsupported activation function: silu"):
            HFOPTLayerPolicy(None)  # OPT's own check is untouched
    finally:
        TransformerPolicy.hf_model_config = saved


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only patch")
def test_upstream_ops_have_no_cpu_kernels_and_fallbacks_are_scoped():
    config = DeepSpeedInferenceConfig(hidden_size=64, heads=4)
    before = BaseOp.inference_module
    with pytest.raises(ValueError, match="not been implemented on CPU"):
        QKVGemmOp(config)
    with compat.cpu_op_fallbacks():
        op = QKVGemmOp(config)
    assert op.qkv_gemm_func == op.qkv_gemm_fallback
    assert BaseOp.inference_module is before  # restored: other models see upstream behaviour


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only patch")
def test_upstream_workspace_prints_a_line_per_layer_and_ours_is_quiet(ckpt_factory, capsys):
    """WorkspaceOp.__init__ print()s its fallback notice (compat 3b drops it while our layer is built)."""
    from deepspeed.ops.transformer.inference.op_binding.workspace import WorkspaceOp

    assert 'print(f"Using fallback functions in workspace because of {e}")' in inspect.getsource(WorkspaceOp.__init__)
    with compat.cpu_op_fallbacks():
        WorkspaceOp(DeepSpeedInferenceConfig(hidden_size=64, heads=4, dtype=torch.float32))
    assert "Using fallback functions in workspace" in capsys.readouterr().out
    hf_and_injected(ckpt_factory("tiny"))
    assert "Using fallback functions in workspace" not in capsys.readouterr().out


def test_upstream_mlp_fallback_uses_erf_gelu_ours_tanh():
    config = DeepSpeedInferenceConfig(hidden_size=8, heads=2, dtype=torch.float32)
    with compat.cpu_op_fallbacks():
        theirs, ours = MLPGemmOp(config), GPTBigCodeMLPGemmOp(config)
    g = torch.Generator().manual_seed(0)
    x, res, b_in = (torch.randn(2, 3, 8, generator=g) for _ in range(3))
    w1, b1, w2 = torch.randn(8, 32, generator=g), torch.randn(32, generator=g), torch.randn(32, 8, generator=g)
    gamma, beta = torch.ones(8), torch.zeros(8)
    args = (x, res, b_in, w1, w2, b1, gamma, beta, 1e-5, True, True, None, None, False, None, False)
    ln = F.layer_norm(x + res + b_in, (8, ), gamma, beta, 1e-5)
    erf = F.gelu(ln @ w1 + b1) @ w2
    tanh = F.gelu(ln @ w1 + b1, approximate="tanh") @ w2
    assert torch.allclose(theirs.mlp_gemm_fallback(*args)[0], erf, atol=1e-5)
    assert not torch.allclose(erf, tanh, atol=1e-4)
    assert torch.allclose(ours.mlp_gemm_fallback(*args)[0], tanh, atol=1e-5)


# --- the injected model ---------------------------------------------------------------------------

@pytest.mark.parametrize("name,overrides", SHAPES, ids=SHAPE_IDS)
def test_every_block_is_a_deepspeed_layer_built_by_our_container(models, name, overrides):
    hf, engine = models(name, overrides)
    cfg = hf.config
    kv = 1 if cfg.multi_query else cfg.n_head
    head_dim = cfg.n_embd // cfg.n_head
    assert not any(isinstance(m, GPTBigCodeBlock) for m in engine.module.modules())
    assert len(engine.module.transformer.h) == cfg.n_layer
    for i, layer in enumerate(engine.module.transformer.h):
        assert isinstance(layer, DeepSpeedGPTBigCodeInference) and isinstance(layer, DeepSpeedTransformerInference)
        assert layer.layer_idx == i and layer.config.num_kv == kv
        # fused c_attn kept whole: [Q | K | V] for MQA, per-head [q, k, v] for MHA, stored [in, out]
        assert layer.attention.attn_qkvw.shape == (cfg.n_embd, cfg.n_embd + 2 * kv * head_dim)
        ref = hf.transformer.h[i].attn.c_attn.weight
        assert torch.equal(layer.attention.attn_qkvw, ref.t())


@pytest.mark.parametrize("name,overrides", SHAPES, ids=SHAPE_IDS)
def test_fp32_logits_match_hf_on_a_left_padded_batch(models, padded_batch, name, overrides):
    hf, engine = models(name, overrides)
    _, ids, mask = padded_batch
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=False).logits
        out = engine.module(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask),
                            use_cache=False).logits
    assert (out - ref)[mask.bool()].abs().max() <= 1e-5
    assert ref.abs().max() > 0.1  # not a degenerate model


@pytest.mark.parametrize("name,overrides", SHAPES[:2], ids=SHAPE_IDS[:2])
def test_hf_generate_greedy_64_tokens_identical(models, padded_batch, name, overrides):
    """The user's call: engine.module.generate on a left-padded batch, HF's default cache."""
    hf, engine = models(name, overrides)
    _, ids, mask = padded_batch
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    ref = hf.generate(ids, **kwargs)
    out = engine.module.generate(ids, return_dict_in_generate=True, **kwargs)
    assert out.sequences.shape == (3, ids.shape[1] + NEW_TOKENS)
    assert torch.equal(out.sequences, ref)
    # HF's default cache was taken over: one preallocated KV head per layer (MQA), never grown
    capacity = min(engine._config.max_out_tokens, hf.config.n_positions)
    kv = 1 if hf.config.multi_query else hf.config.n_head
    for layer in out.cache.layers:
        assert isinstance(layer, SingleHeadLayer)
        assert layer.keys.shape == layer.values.shape == (3, kv, capacity, hf.config.n_embd // hf.config.n_head)
        assert layer.get_seq_length() == ids.shape[1] + NEW_TOKENS - 1


@pytest.mark.parametrize("name,overrides", SHAPES[:2], ids=SHAPE_IDS[:2])
def test_hf_generate_sampling_is_reproducible_and_matches_hf(models, padded_batch, name, overrides):
    hf, engine = models(name, overrides)
    _, ids, mask = padded_batch
    kwargs = dict(attention_mask=mask, max_new_tokens=32, min_new_tokens=32, do_sample=True, top_k=50, top_p=0.95,
                  temperature=0.8)
    runs = []
    for model in (engine.module, engine.module, hf):
        torch.manual_seed(1234)
        runs.append(model.generate(ids, **kwargs))
    assert torch.equal(runs[0], runs[1])
    assert torch.equal(runs[0], runs[2])


# --- the Backend and its cache -----------------------------------------------------------------

@pytest.mark.parametrize("name,overrides", SHAPES[:3], ids=SHAPE_IDS[:3])
def test_backend_generate_matches_hf_backend(ckpt_factory, padded_batch, name, overrides):
    hf_dir = ckpt_factory(name, **overrides)
    _, ids, mask = padded_batch
    ds, hf = load_backend("deepspeed", hf_dir), HFBackend.from_hf(hf_dir)
    assert (ds.logits(ids, mask) - hf.logits(ids, mask))[mask.bool()].abs().max() <= 1e-5
    greedy = ds.generate(ids, mask, NEW_TOKENS)
    assert torch.equal(greedy.tokens, hf.generate(ids, mask, NEW_TOKENS).tokens)
    assert greedy.tokens.shape == (3, ids.shape[1] + NEW_TOKENS) and len(greedy.step_s) == NEW_TOKENS - 1
    a, b = (ds.generate(ids, mask, 24, do_sample=True, top_k=40, top_p=0.9, seed=7) for _ in range(2))
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.tokens, hf.generate(ids, mask, 24, do_sample=True, top_k=40, top_p=0.9, seed=7).tokens)
    assert not torch.equal(a.tokens, ds.generate(ids, mask, 24, do_sample=True, top_k=40, top_p=0.9, seed=8).tokens)


@pytest.mark.parametrize("name", ["tiny", "tiny-mha"])
def test_kv_cache_is_preallocated_single_head_and_exactly_sized(ckpt_factory, padded_batch, name):
    ds = load_backend("deepspeed", ckpt_factory(name))
    cfg = ds.config
    _, ids, mask = padded_batch
    batch, seq = ids.shape[0], ids.shape[1] + NEW_TOKENS - 1  # the last new token is never fed back
    head_dim, kv = cfg.n_embd // cfg.n_head, (1 if cfg.multi_query else cfg.n_head)
    decoder = ds.decoder(batch, seq)
    cache = decoder.cache
    ptrs = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]
    result = generate(decoder, ids, mask, NEW_TOKENS, Sampler())
    for layer, ptr in zip(cache.layers, ptrs):
        assert layer.keys.shape == layer.values.shape == (batch, kv, seq, head_dim)
        assert (layer.keys.data_ptr(), layer.values.data_ptr()) == ptr  # written in place, never reallocated
    expected = 2 * cfg.n_layer * batch * seq * head_dim * 4 * kv  # fp32
    assert result.kv_cache_bytes == cache.nbytes() == expected
    assert ds.generate(ids, mask, NEW_TOKENS).kv_cache_bytes == expected
    if cfg.multi_query:
        assert expected == 2 * cfg.n_layer * batch * seq * head_dim * 4  # one KV head


def test_cache_refuses_to_overflow(ckpt_factory):
    cfg = load_hf_model(ckpt_factory("tiny")).config
    cache = SingleHeadCache(cfg, max_length=4, batch=1, dtype=torch.float32)
    k = torch.zeros(1, 1, 3, cfg.n_embd // cfg.n_head)
    cache.update(k, k, 0)
    with pytest.raises(ValueError, match="KV cache full"):
        cache.update(k, k, 0)
    with pytest.raises(ValueError, match="exceeds n_positions"):
        SingleHeadCache(cfg, max_length=cfg.n_positions + 1)


@pytest.mark.kernels
@pytest.mark.parametrize("name", ["tiny", "tiny-mha"])
def test_bf16_logits_within_tolerance_of_fp32_hf(ckpt_factory, padded_batch, name):
    """bf16 (prefill rows on this CPU's rung: oneDNN or fp32): stated tolerance 1e-2 absolute on logits of scale ~1, no
    worse than 2x HF's own bf16 error against fp32; greedy argmax agrees on >= 95 % of positions."""
    hf_dir = ckpt_factory(name)
    _, ids, mask = padded_batch
    real = mask.bool()
    ref = HFBackend.from_hf(hf_dir).logits(ids, mask)[real]
    hf16 = HFBackend.from_hf(hf_dir, dtype="bfloat16").logits(ids, mask)[real]
    ds16 = load_backend("deepspeed", hf_dir, dtype="bfloat16").logits(ids, mask)[real]
    err, hf_err = (ds16 - ref).abs().max().item(), (hf16 - ref).abs().max().item()
    assert err <= 1e-2 and err <= 2 * hf_err + 1e-3, (err, hf_err)
    assert (ds16.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.95


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_kernels_match_hf(ckpt_factory, padded_batch):
    hf_dir = ckpt_factory("tiny")
    _, ids, mask = padded_batch
    ds = load_backend("deepspeed", hf_dir, dtype="float16", device="cuda")
    hf = HFBackend.from_hf(hf_dir, dtype="float16", device="cuda")
    assert (ds.logits(ids, mask) - hf.logits(ids, mask))[mask.bool()].abs().max() <= 2e-2
    assert (ds.generate(ids, mask, 16).tokens == hf.generate(ids, mask, 16).tokens).float().mean() >= 0.9


def test_unsupported_activation_is_a_clear_error(ckpt_factory):
    injection.register()
    model = load_hf_model(ckpt_factory("tiny"))
    model.config.activation_function = "relu"
    with pytest.raises(ValueError, match="supports tanh GELU"):
        deepspeed.init_inference(model, dtype=torch.float32, replace_with_kernel_inject=True)


def test_container_is_registered_for_our_policy_only():
    injection.register()
    assert compat._containers == {GPTBigCodePolicy: GPTBigCodeContainer, Starcoder2Policy: Starcoder2Container}

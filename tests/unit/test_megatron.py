"""megatron-core adapter: parity with HF (fp32, left-padded batch, MQA and MHA), KV cache, dist checkpoints,
bad input, and one test per CPU patch in plugins/megatron/compat.py (TP 2: tests/integration/test_megatron_tp.py)."""

import inspect
import types
from pathlib import Path

import pytest
import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from safetensors.torch import load_file

from converters import megatron_core
from plugins.core.config import ConfigError, head_dim, kv_heads
from plugins.engine.generation import generate
from plugins.engine.registry import load_backend
from plugins.engine.sampling import Sampler
from plugins.hf import HFBackend
from plugins.megatron import MegatronGPT, compat
from plugins.megatron.attention import SDPAttention
from plugins.megatron.model import build_model, check_config

TOL = 1e-5


def real(x, mask):
    """Only positions holding tokens: HF and megatron differ (harmlessly) on padded rows."""
    return x[mask.bool()]


@pytest.fixture(scope="module")
def hf_models():
    made = {}

    def get(path):
        if path not in made:
            made[path] = HFBackend.from_hf(path)
        return made[path]

    return get


# ---------------------------------------------------------------- parity with HF, single process

def test_config_mapping(tiny_dir):
    m = MegatronGPT.from_hf(tiny_dir)
    tc = m.model.config
    assert tc.num_query_groups == kv_heads(m.config) and tc.kv_channels == head_dim(m.config)
    assert tc.num_layers == m.config.n_layer and tc.layernorm_epsilon == m.config.layer_norm_epsilon
    assert m.model.share_embeddings_and_output_weights == m.config.tie_word_embeddings
    qkv = m.model.decoder.layers[0].self_attention.linear_qkv.weight
    assert tuple(qkv.shape) == (m.config.n_embd + 2 * kv_heads(m.config) * head_dim(m.config), m.config.n_embd)
    assert isinstance(m, MegatronGPT) and load_backend("megatron", tiny_dir).name == "megatron"
    core = {type(layer.self_attention.core_attention) for layer in m.model.decoder.layers}
    assert core == {SDPAttention}
    core = MegatronGPT.from_hf(tiny_dir, attention="megatron").model.decoder.layers[0].self_attention.core_attention
    assert type(core) is DotProductAttention


ATTENTION = pytest.mark.parametrize("attention", ["sdpa", "megatron"])  # ours / megatron's DotProductAttention


@ATTENTION
def test_logits_match_hf(tiny_dir, attention, padded_batch, hf_models):
    _, ids, mask = padded_batch
    ours = MegatronGPT.from_hf(tiny_dir, attention=attention).logits(ids, mask)
    ref = hf_models(tiny_dir).logits(ids, mask)
    assert ours.shape == ref.shape == (*ids.shape, 49152)
    assert (real(ours, mask) - real(ref, mask)).abs().max() <= TOL


@ATTENTION
def test_greedy_64_tokens_match_hf_with_single_head_cache(tiny_dir, attention, padded_batch, hf_models):
    _, ids, mask = padded_batch
    m = MegatronGPT.from_hf(tiny_dir, attention=attention)
    res = m.generate(ids, mask, max_new_tokens=64)
    ref = hf_models(tiny_dir).generate(ids, mask, max_new_tokens=64)
    assert res.tokens.shape == (3, ids.shape[1] + 64)
    assert torch.equal(res.tokens, ref.tokens)
    # The static cache: per layer K and V of [max_seq, batch, kv_heads, head_dim], fp32.
    # The last new token is never fed back, so the cache holds T + 63 positions (as HF's does).
    decoder = m.decoder(3, ids.shape[1] + 63)
    generate(decoder, ids, mask, 64, Sampler())
    cfg = m.config
    shapes = {tuple(t.shape) for kv in decoder.ctx.key_value_memory_dict.values() for t in kv}
    assert shapes == {(ids.shape[1] + 63, 3, kv_heads(cfg), head_dim(cfg))}
    assert len(decoder.ctx.key_value_memory_dict) == cfg.n_layer
    expected = cfg.n_layer * 2 * (ids.shape[1] + 63) * 3 * kv_heads(cfg) * head_dim(cfg) * 4
    assert res.kv_cache_bytes == decoder.kv_cache_bytes() == expected
    if cfg.multi_query:
        assert kv_heads(cfg) == 1


def test_sampling_matches_hf(tiny_dir, padded_batch, hf_models):
    _, ids, mask = padded_batch
    kw = dict(max_new_tokens=16, do_sample=True, temperature=0.8, top_k=50, top_p=0.95, seed=3)
    assert torch.equal(MegatronGPT.from_hf(tiny_dir).generate(ids, mask, **kw).tokens,
                       hf_models(tiny_dir).generate(ids, mask, **kw).tokens)


class Recorder:
    """Wraps a decoder and keeps the logits of every step."""

    def __init__(self, decoder):
        self.decoder, self.steps = decoder, []

    def prefill(self, *a):
        self.steps.append(self.decoder.prefill(*a))
        return self.steps[-1]

    def decode(self, *a):
        self.steps.append(self.decoder.decode(*a))
        return self.steps[-1]

    def kv_cache_bytes(self):
        return self.decoder.kv_cache_bytes()


@ATTENTION
def test_cached_decode_equals_full_recompute(tiny_dir, attention, padded_batch):
    _, ids, mask = padded_batch
    m = MegatronGPT.from_hf(tiny_dir, attention=attention)
    n, t = 12, ids.shape[1]
    rec = Recorder(m.decoder(3, t + n))
    res = generate(rec, ids, mask, n, Sampler())
    full_mask = torch.cat([mask, torch.ones(3, n, dtype=mask.dtype)], 1)
    full = m.logits(res.tokens, full_mask)  # no cache: one forward over prompt + generated tokens
    for step, logits in enumerate(rec.steps):
        assert (logits - full[:, t - 1 + step]).abs().max() <= TOL


def test_bf16_runs(ckpt_factory, padded_batch):
    _, ids, mask = padded_batch
    m = MegatronGPT.from_hf(ckpt_factory("tiny"), dtype="bfloat16")
    assert m.model.embedding.word_embeddings.weight.dtype == torch.bfloat16
    res = m.generate(ids, mask, 4)
    assert res.tokens.shape == (3, ids.shape[1] + 4)
    assert res.kv_cache_bytes == 2 * 2 * (ids.shape[1] + 3) * 3 * 1 * 16 * 2  # T + N - 1 positions


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_matches_hf(ckpt_factory, padded_batch):
    _, ids, mask = padded_batch
    path = ckpt_factory("tiny")
    m, hf = MegatronGPT.from_hf(path), HFBackend.from_hf(path)
    assert m.device == "cuda" and next(m.model.parameters()).is_cuda
    assert (real(m.logits(ids, mask), mask) - real(hf.logits(ids, mask), mask)).abs().max() <= 1e-4
    assert torch.equal(m.generate(ids, mask, 16).tokens, hf.generate(ids, mask, 16).tokens)


# ---------------------------------------------------------------- bad input

def test_bad_input_is_refused_before_work(ckpt_factory, padded_batch, tmp_path):
    _, ids, mask = padded_batch
    path = ckpt_factory("tiny")
    with pytest.raises(ConfigError, match="tp_size 3 does not divide n_head 4"):
        MegatronGPT.from_hf(path, tp_size=3)
    with pytest.raises(ConfigError, match="float16 is not supported on CPU"):
        MegatronGPT.from_hf(path, dtype="float16")
    m = MegatronGPT.from_hf(path)
    long = torch.zeros((1, m.config.n_positions + 1), dtype=torch.long)
    with pytest.raises(ConfigError, match="exceeds n_positions 256"):
        m.logits(long, torch.ones_like(long))
    with pytest.raises(ConfigError, match="exceeds n_positions 256"):
        m.generate(ids, mask, max_new_tokens=m.config.n_positions)
    with pytest.raises(ConfigError, match="left-padded"):
        m.logits(ids, mask.flip(1))
    with pytest.raises(ConfigError, match="not a megatron-core checkpoint"):
        MegatronGPT.from_megatron(tmp_path)
    with pytest.raises(ConfigError, match="attention must be 'sdpa' or 'megatron'"):
        MegatronGPT.from_hf(path, attention="flash")
    with pytest.raises(ConfigError, match="unexpected option"):
        MegatronGPT.from_hf(path, launcher="torchrun")


def test_unsupported_activation_is_refused(tiny_dir):
    cfg = MegatronGPT.from_hf(tiny_dir).config
    cfg.activation_function = "relu"
    with pytest.raises(ConfigError, match="activation 'relu' has no Megatron equivalent"):
        check_config(cfg, 1)
    with pytest.raises(ConfigError, match="activation 'relu'"):
        build_model(cfg, 1)


# ---------------------------------------------------------------- megatron-core dist checkpoints

def _hf_state(path):
    return load_file(Path(path) / "model.safetensors")


def test_gqa_checkpoint_sdpa_matches_megatron_attention(ckpt_factory, padded_batch, tmp_path):
    """2 KV groups (pooled from MHA; Megatron-only): our grouped SDPA == megatron's DotProductAttention."""
    from converters.mapping import pool_kv_heads

    _, ids, mask = padded_batch
    path = ckpt_factory("tiny-mha")
    config, state = pool_kv_heads(_hf_state(path), MegatronGPT.from_hf(path).config, 2)
    megatron_core.write(config, state, tmp_path)
    ours, ref = (MegatronGPT.from_megatron(tmp_path, attention=a) for a in ("sdpa", "megatron"))
    assert ours.model.config.num_query_groups == 2
    assert (real(ours.logits(ids, mask), mask) - real(ref.logits(ids, mask), mask)).abs().max() <= TOL
    res, ref_res = ours.generate(ids, mask, 16), ref.generate(ids, mask, 16)
    assert torch.equal(res.tokens, ref_res.tokens)
    assert res.kv_cache_bytes == 2 * 2 * (ids.shape[1] + 15) * 3 * 2 * 16 * 4  # 2 KV heads, T + N - 1


# ---------------------------------------------------------------- CPU patches: still needed, still the same shape

needs_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU patches are not applied with CUDA")


@needs_cpu
def test_compat_current_device_is_still_needed():
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.attention import Attention
    from megatron.core.utils import GlobalMemoryBuffer

    for fn in (Attention._allocate_memory, GlobalMemoryBuffer.get_tensor, mappings._gather_along_last_dim):
        assert "torch.cuda.current_device()" in inspect.getsource(fn), fn.__qualname__
    with pytest.raises(AssertionError, match="not compiled with CUDA"):
        compat.ORIGINAL["current_device"]()
    compat.apply()
    assert torch.cuda.current_device() == "cpu"


@needs_cpu
def test_compat_synchronize_is_still_needed():
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    assert "torch.cuda.synchronize()" in inspect.getsource(FileSystemWriterAsync.preload_tensors)
    with pytest.raises(AssertionError, match="not compiled with CUDA"):
        compat.ORIGINAL["synchronize"]()


@needs_cpu
def test_compat_inference_rng_tracker_is_still_needed():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker, get_cuda_rng_tracker

    with pytest.raises(AssertionError, match="not compiled with CUDA"):
        tracker = CudaRNGStatesTracker()
        tracker.add("model-parallel-rng", 1)  # what the training tracker does before fork()
    compat.apply()
    with get_cuda_rng_tracker().fork():  # DotProductAttention enters this around dropout
        pass


@needs_cpu
def test_default_causal_mask_is_cuda_only():
    """Why the adapter always passes an explicit mask (plugins/megatron/decoder.py)."""
    from megatron.core.transformer.utils import get_default_causal_mask

    with pytest.raises(AssertionError, match="not compiled with CUDA"):
        get_default_causal_mask(4)


@needs_cpu
@pytest.mark.kernels
def test_compat_linears_run_the_probes_choice():
    """Upstream's _forward_impl is F.linear (frozen weights); a bf16 call the probe sends to our kernels
    or to fp32 now returns exactly `kernels.linear`'s output, any other call exactly upstream's."""
    from megatron.core.tensor_parallel import layers

    from plugins import kernels

    compat.apply()
    for cls in (layers.ColumnParallelLinear, layers.RowParallelLinear):
        assert "linear_with_frozen_weight(input, weight" in \
            inspect.getsource(compat.ORIGINAL[f"{cls.__name__}._forward_impl"])
        assert "self._forward_impl(\n            input=input_parallel," in inspect.getsource(cls.forward)
    impl = layers.ColumnParallelLinear._forward_impl
    upstream = compat.ORIGINAL["ColumnParallelLinear._forward_impl"]
    w, b = torch.randn(40, 64).bfloat16(), torch.randn(40).bfloat16()
    kw = dict(bias=b, gradient_accumulation_fusion=False, allreduce_dgrad=False, sequence_parallel=False,
              tp_group=None, grad_output_buffer=None)
    linear = types.SimpleNamespace()  # stands in for the module: ours keeps its weight packs on it
    with torch.inference_mode():
        for rows in (1, 3, 40):
            x = torch.randn(rows, 1, 64).bfloat16()
            want = (kernels.linear(x, w, b) if kernels.probe().bf16(rows) in (*kernels.ROW_INVARIANT, "fp32")
                    else upstream(None, input=x, weight=w, **kw))
            assert torch.equal(impl(linear, input=x, weight=w, **kw), want)
        if kernels.probe().bf16(1) in kernels.TILED:
            assert len(linear._decode_packs.packed) == 1  # packed once, reused at every row count
        x = torch.randn(3, 1, 64)  # fp32: always upstream
        assert torch.equal(impl(None, input=x, weight=w.float(), **{**kw, "bias": b.float()}),
                           upstream(None, input=x, weight=w.float(), **{**kw, "bias": b.float()}))


@pytest.mark.kernels
def test_bf16_batch1_decode_matches_fp32_hf(ckpt_factory, tokenizer, hf_models):
    """Batch 1 in bf16 (one-row steps: the decode kernel on CPU): logits within the bf16 tolerance."""
    from plugins.core.tensors import position_ids
    from plugins.core.tokenizer import prompt_token_ids

    path = ckpt_factory("tiny")
    m = MegatronGPT.from_hf(path, dtype="bfloat16")
    ids = torch.tensor([prompt_token_ids(tokenizer, 9, 0)])
    mask = torch.ones_like(ids)
    dec = m.decoder(1, ids.shape[1] + 3)
    pos = position_ids(mask)
    nxt = torch.tensor([[5], [7], [11]])
    with torch.inference_mode():
        dec.prefill(ids, mask, pos)
        steps = [dec.decode(nxt[i:i + 1], torch.ones(1, ids.shape[1] + i + 1, dtype=mask.dtype),
                            pos[:, -1:] + 1 + i).float() for i in range(3)]
    want = hf_models(path).logits(torch.cat([ids, nxt.t()], 1),
                                  torch.ones(1, ids.shape[1] + 3, dtype=mask.dtype))[0, -3:]
    err = (torch.cat(steps) - want).abs().max().item()
    assert err <= 1e-2, err
    m.close()

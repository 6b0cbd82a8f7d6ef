"""The DeepSpeed-injected backend (plugins.deepspeed): its fast decode step, and the speed options
(int8, int4, speculative decoding, torch.compile), each checked against the plain path."""

import pytest
import torch

from injection.one_token import OneTokenStep
from plugins import kernels
from plugins.core.config import ConfigError
from plugins.core.tensors import position_ids
from plugins.core.tokenizer import prompt_token_ids
from plugins.deepspeed.decoder import InjectedDecoder, compiled
from plugins.engine.registry import load_backend
from plugins.kernels import layer_ops

LINEAR_WEIGHTS = (("attention", "attn_qkvw"), ("attention", "attn_ow"), ("mlp", "inter_w"), ("mlp", "output_w"))


def linear_pairs(ref, quantized):
    """(reference weight, quantized weight) of the four linears of every injected layer."""
    for ref_layer, q_layer in zip(ref.model.transformer.h, quantized.model.transformer.h):
        for owner, attr in LINEAR_WEIGHTS:
            yield getattr(getattr(ref_layer, owner), attr), getattr(getattr(q_layer, owner), attr)


def test_injected_decoder_matches_hf_forward_and_rolls_back_in_place(tiny_dir, padded_batch):
    """The fast decode step (no HF model forward) gives HF's fp32 logits; rollback keeps the buffers."""
    _, ids, mask = padded_batch
    ds = load_backend("deepspeed", tiny_dir)
    hf = load_backend("hf", tiny_dir)
    dec = ds.decoder(ids.shape[0], ids.shape[1] + 4)
    assert isinstance(dec, InjectedDecoder)
    pos = position_ids(mask)
    dec.prefill(ids, mask, pos)
    ptrs = [layer.keys.data_ptr() for layer in dec.cache.layers]
    nxt = torch.tensor([[5], [7], [11]])
    full_mask = torch.cat([mask, torch.ones(3, 2, dtype=mask.dtype)], 1)
    step1 = dec.decode(nxt, full_mask[:, :-1], pos[:, -1:] + 1)
    dec.rollback(1)
    assert dec.cache.get_seq_length() == ids.shape[1]
    again = dec.forward_tokens(torch.cat([nxt, nxt], 1), full_mask, pos[:, -1:] + torch.tensor([[1, 2]]))
    assert [layer.keys.data_ptr() for layer in dec.cache.layers] == ptrs  # never reallocated
    want = hf.logits(torch.cat([ids, nxt, nxt], 1), full_mask)
    assert (step1 - want[:, -2]).abs().max() <= 1e-5
    assert (again - want[:, -2:]).abs().max() <= 1e-5


@pytest.mark.kernels
@pytest.mark.parametrize("name", ["tiny", "tiny-mha"])
def test_deepspeed_int8_agrees_with_bf16_and_halves_linear_bytes(name, ckpt_factory, padded_batch):
    _, ids, mask = padded_batch
    path = ckpt_factory(name)
    ref = load_backend("deepspeed", path, dtype="bfloat16")
    q = load_backend("deepspeed", path, dtype="bfloat16", quantize="int8", quantize_lm_head=True)
    ref_bytes = q_bytes = 0
    for w, qw in linear_pairs(ref, q):
        assert qw.dtype == torch.int8 and qw.shape == w.t().shape and qw.scale.shape == (w.shape[1],)
        ref_bytes += w.numel() * w.element_size()
        q_bytes += qw.numel() * qw.element_size() + qw.scale.numel() * qw.scale.element_size()
    assert 0.45 < q_bytes / ref_bytes < 0.56
    assert q.model.lm_head.weight_int8.dtype == torch.int8
    a, b = ref.generate(ids, mask, 32), q.generate(ids, mask, 32)
    agreement = (a.tokens[:, -32:] == b.tokens[:, -32:]).float().mean().item()
    assert agreement >= 0.95, agreement
    diff = (ref.logits(ids, mask) - q.logits(ids, mask))[mask.bool()].abs().max().item()
    print(f"{name}: int8 greedy agreement {agreement:.3f}, max |logit diff| vs bf16 {diff:.3g}")


@pytest.mark.kernels
@pytest.mark.parametrize("name", ["tiny", "tiny-mha"])
def test_deepspeed_int4_runs_the_quantized_linears_and_stays_close(name, ckpt_factory, padded_batch):
    _, ids, mask = padded_batch
    path = ckpt_factory(name)
    ref = load_backend("deepspeed", path, dtype="bfloat16")
    q = load_backend("deepspeed", path, dtype="bfloat16", quantize="int4", quantize_lm_head=True)
    for w, qw in linear_pairs(ref, q):
        assert qw.dtype == torch.uint8 and qw.int4.shape == tuple(w.t().shape)
    assert q.model.lm_head.weight_int4.shape == tuple(ref.model.lm_head.weight.shape)
    res = q.generate(ids, mask, 16)
    assert res.tokens.shape == (ids.shape[0], ids.shape[1] + 16) and torch.equal(res.tokens[:, :ids.shape[1]], ids)
    real = mask.bool()
    want = ref.logits(ids, mask)[real].float()
    assert (q.logits(ids, mask)[real].float() - want).abs().mean() < 0.1 * want.std()
    with pytest.raises(ConfigError, match="runs on CPU"):
        load_backend("deepspeed", path, device="cuda", quantize="int4")


DRAFTS = [(4, "int8"), (1, "int8"), (4, "int4"), (3, "other weights"), (4, "prompt-lookup")]


def _speculative(path, k, draft, ckpt_factory, name, dtype):
    options = {"k": k, "draft": ckpt_factory(name, seed=9) if draft == "other weights" else draft}
    return load_backend("deepspeed", path, dtype=dtype, speculative=options)


@pytest.mark.parametrize("name", ["tiny", "tiny-mha"])
def test_deepspeed_speculative_equals_plain_greedy(name, ckpt_factory, padded_batch):
    _, ids, mask = padded_batch
    path = ckpt_factory(name)
    plain = load_backend("deepspeed", path).generate(ids, mask, 40)
    for k, draft in DRAFTS:
        spec = _speculative(path, k, draft, ckpt_factory, name, "float32")
        res = spec.generate(ids, mask, 40)
        assert torch.equal(res.tokens, plain.tokens), (k, draft)
        assert res.stats["k"] == k and len(res.step_s) == 39
        if draft == "int8":
            assert res.stats["acceptance_rate"] >= 0.8
            assert spec.draft.model.transformer.h[0].attention.attn_qkvw.dtype == torch.int8
        if draft == "int4":
            assert spec.draft.model.transformer.h[0].attention.attn_qkvw.dtype == torch.uint8
        assert spec.model.transformer.h[0].attention.attn_qkvw.dtype == torch.float32  # the target is untouched
    with pytest.raises(ConfigError, match="greedy only"):
        spec.generate(ids, mask, 8, do_sample=True)


@pytest.mark.kernels
@pytest.mark.parametrize("name", ["tiny", "tiny-mha"])
def test_deepspeed_bf16_speculative_equals_plain_greedy(name, ckpt_factory, padded_batch):
    """bf16, every draft kind, end to end. These small random models' top tokens are not close enough
    for a GEMM's bf16 rounding to flip them (this passes without rows_alone too): what makes the
    verify exact is checked on its logits, bit for bit, by the next test."""
    if kernels.probe().bf16(1) not in kernels.ROW_INVARIANT:
        pytest.skip(f"no row-invariant bf16 kernel on the {kernels.probe().rung} rung")
    _, ids, mask = padded_batch
    path = ckpt_factory(name)
    plain = load_backend("deepspeed", path, dtype="bfloat16")
    # one prompt at a time: plain decoding of one row runs the kernel on every rung that has one
    rows = [(ids[i:i + 1, mask[i].argmax():], mask[i:i + 1, mask[i].argmax():]) for i in range(len(ids))]
    want = [plain.generate(i, m, 40).tokens for i, m in rows]
    for k, draft in DRAFTS:
        spec = _speculative(path, k, draft, ckpt_factory, name, "bfloat16")
        for (i, m), w in zip(rows, want):
            assert torch.equal(spec.generate(i, m, 40).tokens, w), (k, draft)


@pytest.mark.kernels
def test_bf16_weights_are_packed_at_load_for_every_row_count(tiny_dir):
    """Loading in bf16 packs the layers' and the LM head's weights for each layout the kernel table
    picks at some row count; forwards of one row count per bucket then pack nothing more."""
    ds = load_backend("deepspeed", tiny_dir, dtype="bfloat16")
    stores = [op.packs for block in ds.model.transformer.h
              for op in (block.attention.qkv_func, block.attention.vector_matmul_func, block.mlp.mlp_gemm_func)]
    stores.append(ds.model.lm_head.decode_packs)
    layouts = {"tiles" if impl in kernels.TILED else impl for impl in kernels.packed_bf16_impls()}
    weights = 4 * len(ds.model.transformer.h) + 1
    made = sum(len(store.packed) for store in stores)
    assert made == weights * len(layouts), (made, layouts)
    for rows in (1, *(top + 1 for top in kernels.BUCKETS)):
        t = min(rows, ds.config.n_positions - 2)
        ids = torch.randint(0, ds.config.vocab_size, (-(-rows // t), t))
        ds.generate(ids, torch.ones_like(ids), 2)
    assert sum(len(store.packed) for store in stores) == made


@pytest.mark.kernels
@pytest.mark.parametrize("name", ["tiny", "tiny-mha"])
def test_bf16_verify_logits_equal_one_token_steps(name, ckpt_factory, padded_batch):
    if kernels.probe().bf16(1) not in kernels.ROW_INVARIANT:
        pytest.skip(f"no row-invariant bf16 kernel on the {kernels.probe().rung} rung")
    _, ids, mask = padded_batch
    ds = load_backend("deepspeed", ckpt_factory(name), dtype="bfloat16")
    for row, new in zip(range(len(ids)), ([5, 9, 2, 7, 3], [7, 1, 4, 4, 8], [11, 6, 0, 2, 5])):
        prompt = ids[row:row + 1, mask[row].argmax():]  # one row: plain decoding runs the kernel
        dec = ds.decoder(1, prompt.shape[1] + 5)
        dec.prefill(prompt, torch.ones_like(prompt), position_ids(torch.ones_like(prompt)))
        new = torch.tensor([new])
        full_mask = torch.ones(1, prompt.shape[1] + 5, dtype=torch.long)
        new_pos = prompt.shape[1] - 1 + torch.arange(1, 6)[None]
        verify = dec.forward_tokens(new, full_mask, new_pos)
        dec.rollback(5)
        steps = torch.stack([dec.decode(new[:, t:t + 1], full_mask[:, :prompt.shape[1] + t + 1], new_pos[:, t:t + 1])
                             for t in range(5)], 1)
        assert torch.equal(verify, steps)


@pytest.mark.kernels
@pytest.mark.parametrize("padded", [True, False])
def test_bf16_one_token_step_gives_the_op_bindings_bits(ckpt_factory, padded_batch, monkeypatch, padded):
    """A bf16 MQA decode step runs each layer's direct one-token step (injection.one_token) wherever the
    rung has the fused kernels, and its logits and cache are those of DeepSpeed's op bindings, bit for bit."""
    _, ids, mask = padded_batch
    if not padded:
        ids, mask = ids[:, -3:], torch.ones_like(mask[:, -3:])
    ds = load_backend("deepspeed", ckpt_factory("tiny"), dtype="bfloat16")
    noise = torch.Generator().manual_seed(1)
    for block in ds.model.transformer.h:  # the checkpoint's biases are zero: give each its own values
        for bias in (block.norm_b, block.attention.attn_qkvb, block.attention.attn_ob, block.mlp.attn_nb,
                     block.mlp.inter_b, block.mlp.output_b):
            bias.data.copy_(0.1 * torch.randn(bias.shape, generator=noise))
    calls = []
    direct_call = OneTokenStep.__call__
    monkeypatch.setattr(OneTokenStep, "__call__", lambda self, *a: calls.append(1) or direct_call(self, *a))
    dec = ds.decoder(ids.shape[0], ids.shape[1] + 3)
    pos = position_ids(mask)
    dec.prefill(ids, mask, pos)
    new = torch.tensor([[5, 9], [7, 1], [11, 6]])
    full_mask = torch.cat([mask, torch.ones(3, 2, dtype=mask.dtype)], 1)

    def two_steps():
        steps = [dec.decode(new[:, t:t + 1], full_mask[:, :ids.shape[1] + t + 1], pos[:, -1:] + 1 + t)
                 for t in range(2)]
        kv = [t[:, :, :ids.shape[1] + 2].clone() for layer in dec.cache.layers for t in (layer.keys, layer.values)]
        dec.rollback(2)
        return torch.stack(steps), kv

    direct, direct_kv = two_steps()
    layers = len(dec.cache.layers)
    assert len(calls) == (2 * layers if layer_ops.compiled("add_residuals_") is not None else 0)
    monkeypatch.setattr(OneTokenStep, "takes", staticmethod(lambda *a: False))
    bindings, bindings_kv = two_steps()
    assert len(calls) in (0, 2 * layers)
    assert torch.equal(direct, bindings)
    assert all(torch.equal(a, b) for a, b in zip(direct_kv, bindings_kv))


def test_prompt_lookup_accepts_most_drafts_when_the_prompt_holds_the_answer(ckpt_factory, tokenizer):
    """The prompt is the model's own greedy text cut short: the rest of it is what greedy decoding
    writes next, and the earlier text holds it (a small random model's greedy text repeats itself)."""
    path = ckpt_factory("tiny")
    plain = load_backend("deepspeed", path)
    seed = torch.tensor([prompt_token_ids(tokenizer, 16, 0)])
    text = plain.generate(seed, torch.ones_like(seed), 96).tokens
    prompt = text[:, :80]
    spec = load_backend("deepspeed", path, speculative={"draft": "prompt-lookup", "k": 8})
    res = spec.generate(prompt, torch.ones_like(prompt), 32)
    assert torch.equal(res.tokens, plain.generate(prompt, torch.ones_like(prompt), 32).tokens)
    assert res.stats["acceptance_rate"] >= 0.6 and res.stats["tokens_per_round"] >= 3, res.stats


@pytest.mark.parametrize("options, match", [
    ({"quantize": "int3"}, "quantize must be"),
    ({"quantize_lm_head": True}, "needs quantize"),
    ({"speculative": {"k": 0}}, "k must be a positive"),
    ({"speculative": {"k": 2, "depth": 3}}, "keys k, draft"),
    ({"speculative": {"draft": "int8", "ngram": 3}}, "ngram is an option of draft='prompt-lookup'"),
    ({"speculative": {"draft": "prompt-lookup", "ngram": 0}}, "ngram must be a positive"),
    ({"speculative": {"draft": "/nonexistent/draft"}}, "draft"),
])


def test_speed_options_are_checked_before_loading(options, match, ckpt_factory):
    with pytest.raises(ValueError, match=match):
        load_backend("deepspeed", ckpt_factory("tiny"), **options)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_compiled_step_falls_back_to_eager_with_a_warning():
    # A oneDNN-packed weight as a graph input: inductor cannot lower that op (a real compile failure).
    # fp32, which oneDNN packs on every x86 CPU (bf16 packing needs AVX512BW or AVX-NE-CONVERT).
    packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(4, 8), 1)

    def step(x):
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    class Cache:  # what `compiled` needs of a cache: its length, and crop back to it
        cropped = []

        def get_seq_length(self):
            return 3

        def crop(self, n):
            self.cropped.append(n)

    x = torch.randn(2, 1, 8)
    run = compiled(step, Cache())
    with pytest.warns(UserWarning, match="decoding eagerly"):
        assert torch.equal(run(x), step(x))
    assert Cache.cropped == [3]
    assert torch.equal(run(x), step(x))  # eager from now on


def test_deepspeed_compile_option_gives_the_same_tokens(ckpt_factory, padded_batch):
    _, ids, mask = padded_batch
    path = ckpt_factory("tiny")
    plain = load_backend("deepspeed", path).generate(ids, mask, 6)
    res = load_backend("deepspeed", path, compile=True).generate(ids, mask, 6)
    assert torch.equal(res.tokens, plain.tokens)

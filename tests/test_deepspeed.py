"""The DeepSpeed-injected backend (plugins.deepspeed): its fast decode step, and the speed options
(int8, speculative decoding, torch.compile), each checked against the plain path."""

import pytest
import torch

from plugins.core.backend import ConfigError, load_backend, position_ids
from plugins.deepspeed.decoder import InjectedDecoder, compiled

INT8_WEIGHTS = (("attention", "attn_qkvw"), ("attention", "attn_ow"), ("mlp", "inter_w"), ("mlp", "output_w"))


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
    for ref_layer, q_layer in zip(ref.model.transformer.h, q.model.transformer.h):
        for owner, attr in INT8_WEIGHTS:
            w, qw = getattr(getattr(ref_layer, owner), attr), getattr(getattr(q_layer, owner), attr)
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


@pytest.mark.parametrize("name", ["tiny", "tiny-mha"])
def test_deepspeed_speculative_equals_plain_greedy(name, ckpt_factory, padded_batch):
    _, ids, mask = padded_batch
    path = ckpt_factory(name)
    plain = load_backend("deepspeed", path).generate(ids, mask, 40)
    for k, draft, min_rate in ((4, "int8", 0.8), (1, "int8", 0.8), (3, ckpt_factory(name, seed=9), 0.0)):
        spec = load_backend("deepspeed", path, speculative={"k": k, "draft": draft})
        res = spec.generate(ids, mask, 40)
        assert torch.equal(res.tokens, plain.tokens), (k, draft)
        assert res.stats["k"] == k and res.stats["acceptance_rate"] >= min_rate and len(res.step_s) == 39
        layers = spec.draft.model.transformer.h
        assert layers[0].attention.attn_qkvw.dtype == (torch.int8 if draft == "int8" else torch.float32)
        assert spec.model.transformer.h[0].attention.attn_qkvw.dtype == torch.float32  # the target is untouched
    with pytest.raises(ConfigError, match="greedy only"):
        spec.generate(ids, mask, 8, do_sample=True)


@pytest.mark.parametrize("options, match", [
    ({"quantize": "int4"}, "quantize must be"),
    ({"quantize_lm_head": True}, "needs quantize"),
    ({"speculative": {"k": 0}}, "k must be a positive"),
    ({"speculative": {"k": 2, "depth": 3}}, "keys k and draft"),
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

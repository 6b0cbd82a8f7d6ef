"""The HF baseline backend (plugins.hf) on the shared generation loop: padding, caching, sampling, KV bytes."""


import torch

from plugins.core.config import load_model_config
from plugins.engine.contract import Backend
from plugins.engine.registry import load_backend
from plugins.hf import HFBackend


def test_hf_backend_implements_the_protocol(ckpt_factory):
    backend = load_backend("hf", ckpt_factory("tiny"))
    assert isinstance(backend, Backend)


def test_left_padded_batch_equals_each_prompt_alone(tiny_dir, padded_batch):
    seqs, ids, mask = padded_batch
    backend = HFBackend.from_hf(tiny_dir)
    batch = backend.generate(ids, mask, max_new_tokens=16)
    logits = backend.logits(ids, mask)
    for i, seq in enumerate(seqs):
        one = torch.tensor([seq])
        alone = backend.generate(one, torch.ones_like(one), max_new_tokens=16)
        assert torch.equal(alone.tokens[0, -16:], batch.tokens[i, -16:])
        alone_logits = backend.logits(one, torch.ones_like(one))
        assert (alone_logits[0] - logits[i, -len(seq):]).abs().max() < 1e-5
    assert batch.tokens.shape == (3, ids.shape[1] + 16) and len(batch.step_s) == 15 and batch.prefill_s > 0


def test_our_loop_matches_hf_generate_greedy(tiny_dir, padded_batch):
    _, ids, mask = padded_batch
    backend = HFBackend.from_hf(tiny_dir)
    ours = backend.generate(ids, mask, max_new_tokens=12)
    ref = backend.model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.tokens, ref)


def test_cached_decode_equals_full_recompute(tiny_dir, padded_batch):
    _, ids, mask = padded_batch
    backend = HFBackend.from_hf(tiny_dir)
    res = backend.generate(ids, mask, max_new_tokens=8)
    full_mask = torch.cat([mask, torch.ones(3, 8, dtype=mask.dtype)], 1)
    recomputed = backend.logits(res.tokens, full_mask)[:, ids.shape[1] - 1:-1].argmax(-1)
    assert torch.equal(recomputed, res.tokens[:, ids.shape[1]:])


def test_sampling_is_seeded(ckpt_factory, padded_batch):
    _, ids, mask = padded_batch
    backend = HFBackend.from_hf(ckpt_factory("tiny"))
    kw = dict(max_new_tokens=10, do_sample=True, temperature=1.5, top_k=50, top_p=0.9)
    a = backend.generate(ids, mask, seed=7, **kw)
    b = backend.generate(ids, mask, seed=7, **kw)
    c = backend.generate(ids, mask, seed=8, **kw)
    assert torch.equal(a.tokens, b.tokens) and not torch.equal(a.tokens, c.tokens)


def test_kv_cache_bytes_reported(ckpt_factory, padded_batch):
    _, ids, mask = padded_batch
    for name, kv_heads in (("tiny", 1), ("tiny-mha", 4)):
        cfg = load_model_config(name)
        res = HFBackend.from_hf(ckpt_factory(name)).generate(ids, mask, max_new_tokens=5)
        seq = ids.shape[1] + 4  # the last token is sampled, never fed back
        assert res.kv_cache_bytes == 2 * cfg.n_layer * 3 * seq * kv_heads * (cfg.n_embd // cfg.n_head) * 4

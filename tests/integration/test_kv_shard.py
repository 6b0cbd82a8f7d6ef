"""batch-sharded MQA attention under injected TP=2 (injection.kv_shard), two real ranks over gloo.

One torchrun launch runs both KV layouts ("head" = replicated, "batch") on a batch of 4 and the
uneven batch of 3; rank 0 saves logits, tokens and every rank's KV bytes (read from the cache
tensors), and the test compares them with the HF model here.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from injection.kv_shard import KVLayoutError, rank_batch
from plugins.core.checkpoint import read_hf_config
from plugins.core.tensors import position_ids
from plugins.core.tokenizer import left_pad, prompt_token_ids
from plugins.engine.hf_model import HFDecoder
from plugins.engine.registry import load_backend
from plugins.hf import HFBackend

REPO = Path(__file__).resolve().parents[2]
NEW_TOKENS = 64
HF_NEW_TOKENS = 16  # HF generate (its own loop and DynamicCache) on the injected model
SEED = 3

SCRIPT = r"""
import sys
import torch
import torch.distributed as dist
from plugins.deepspeed import DeepSpeedBackend

sys.path.insert(0, sys.argv[7])
from test_kv_shard import cached_logits

hf_dir, batches_path, out_path, new, hf_new, seed = sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7])
dist.init_process_group("gloo")
batches = torch.load(batches_path)
out = {}
for layout in ("head", "batch"):
    ds = DeepSpeedBackend.from_hf(hf_dir, tp_size=2, kv_layout=layout)
    for name, (ids, mask) in batches.items():
        res = ds.generate(ids, mask, new)
        kv_bytes = [None] * dist.get_world_size()
        dist.all_gather_object(kv_bytes, res.kv_cache_bytes)  # each rank: bytes of its cache tensors
        r = {"logits": ds.logits(ids, mask), "tokens": res.tokens, "kv_bytes": kv_bytes,
             "cached_logits": cached_logits(ds.decoder(ids.shape[0], ids.shape[1] + 4), ids, mask, res.tokens)}
        if layout == "batch":
            r["sampled"] = ds.generate(ids, mask, hf_new, do_sample=True, top_k=20, seed=seed).tokens
            r["hf_greedy"] = ds.model.generate(ids, attention_mask=mask, max_new_tokens=hf_new, do_sample=False)
            torch.manual_seed(seed)  # same seed on every rank: ranks sample the same tokens
            r["hf_sampled"] = ds.model.generate(ids, attention_mask=mask, max_new_tokens=hf_new, do_sample=True,
                                                top_k=20)
            try:
                ds.model.generate(ids, attention_mask=mask, max_new_tokens=2, num_beams=2)
            except NotImplementedError as e:
                r["beam_error"] = str(e)
        out[(layout, name)] = r
if dist.get_rank() == 0:
    torch.save(out, out_path)
dist.destroy_process_group()
"""


@torch.inference_mode()
def cached_logits(decoder, ids, mask, tokens, steps=4):
    """Logits of prefill and `steps` decode steps (feeding `tokens`) through the decoder's KV cache."""
    batch, prompt = ids.shape
    pos = position_ids(mask)
    out = [decoder.prefill(ids, mask, pos)]
    for k in range(steps):
        mask = torch.cat([mask, torch.ones(batch, 1, dtype=mask.dtype)], 1)
        out.append(decoder.decode(tokens[:, prompt + k:prompt + k + 1], mask, pos[:, -1:] + 1 + k))
    return torch.stack(out, 1).float()


@pytest.fixture(scope="module")
def mqa_dir(ckpt_factory, tmp_path_factory):
    """tiny (MQA) with random biases and layer norms, so their handling under TP is exercised."""
    from checkpoint_variants import biased_copy  # here: the TP ranks import this file without tests/ on the path

    return biased_copy(ckpt_factory("tiny"), tmp_path_factory.mktemp("kv_shard") / "tiny")


@pytest.fixture(scope="module")
def batches(tokenizer, padded_batch):
    seqs4 = [prompt_token_ids(tokenizer, n, i) for i, n in enumerate((9, 5, 17, 12))]
    _, ids3, mask3 = padded_batch  # lengths 5, 17, 11
    return {"b4": left_pad(seqs4), "b3": (ids3, mask3)}


@pytest.fixture(scope="module")
def ranks_out(mqa_dir, batches, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kv_shard_run")
    (tmp / "run.py").write_text(SCRIPT)
    torch.save(batches, tmp / "batches.pt")
    env = {**os.environ, "LOCAL_SIZE": "2", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(tmp / "run.py"), str(mqa_dir), str(tmp / "batches.pt"), str(tmp / "out.pt"),
                           str(NEW_TOKENS), str(HF_NEW_TOKENS), str(SEED), str(Path(__file__).resolve().parent)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(tmp / "out.pt")


@pytest.mark.slow
@pytest.mark.parametrize("batch", ["b4", "b3"])
@pytest.mark.parametrize("layout", ["head", "batch"])
def test_tp2_kv_layout_matches_hf(ranks_out, mqa_dir, batches, layout, batch):
    ids, mask = batches[batch]
    hf = HFBackend.from_hf(mqa_dir)
    r = ranks_out[(layout, batch)]
    real = mask.bool()
    assert (r["logits"] - hf.logits(ids, mask))[real].abs().max() <= 1e-5
    assert torch.equal(r["tokens"], hf.generate(ids, mask, NEW_TOKENS).tokens)
    # prefill and decode steps through the (batch-sharded) KV cache, against HF's own cache
    want = cached_logits(HFDecoder(hf.model), ids, mask, r["tokens"])
    assert (r["cached_logits"] - want).abs().max() <= 1e-5
    if layout == "batch":  # sampling, and HF's own generate loop (DynamicCache taken over by the injected layers)
        assert torch.equal(r["sampled"], hf.generate(ids, mask, HF_NEW_TOKENS, do_sample=True, top_k=20,
                                                     seed=SEED).tokens)
        assert torch.equal(r["hf_greedy"], hf.model.generate(ids, attention_mask=mask, max_new_tokens=HF_NEW_TOKENS,
                                                             do_sample=False))
        assert "beam search is not supported with kv_layout='batch'" in r["beam_error"]
        torch.manual_seed(SEED)
        assert torch.equal(r["hf_sampled"], hf.model.generate(ids, attention_mask=mask, max_new_tokens=HF_NEW_TOKENS,
                                                              do_sample=True, top_k=20))


@pytest.mark.slow
@pytest.mark.parametrize("batch", ["b4", "b3"])
def test_batch_layout_kv_bytes_per_rank(ranks_out, mqa_dir, batches, batch):
    """Every rank's cache tensors: ceil(B/2) sequences instead of B (exactly half for B=4; B=3 is padded to 4)."""
    cfg = read_hf_config(mqa_dir)
    b, prompt = batches[batch][0].shape
    head, sharded = ranks_out[("head", batch)]["kv_bytes"], ranks_out[("batch", batch)]["kv_bytes"]
    # the shared loop caches prompt + new - 1 tokens; per layer K and V of one head, fp32
    per_sequence = cfg.n_layer * 2 * (prompt + NEW_TOKENS - 1) * (cfg.n_embd // cfg.n_head) * 4
    assert head == [b * per_sequence] * 2                       # replicated: all B sequences on each rank
    assert sharded == [rank_batch(b, 2) * per_sequence] * 2     # batch-sharded: ceil(B / 2) on each rank
    if b % 2 == 0:
        assert 2 * sharded[0] == head[0]


@pytest.mark.slow
def test_backend_option_through_the_deepspeed_launcher(mqa_dir, batches):
    """`load_backend(..., kv_layout="batch")` from a plain process: the option reaches the ranks."""
    ids, mask = batches["b3"]
    hf = HFBackend.from_hf(mqa_dir)
    with load_backend("deepspeed", mqa_dir, tp_size=2, kv_layout="batch", launcher="deepspeed") as ds:
        assert ds.kv_layout == "batch"  # what the bench reports the row with
        result = ds.generate(ids, mask, 8)
    want = hf.generate(ids, mask, 8)
    assert torch.equal(result.tokens, want.tokens)
    assert result.kv_cache_bytes * 3 == want.kv_cache_bytes * rank_batch(3, 2)  # rank 0 caches 2 of 3 sequences


def test_kv_layout_bad_input_fails_before_any_rank_starts(ckpt_factory):
    mqa, mha = ckpt_factory("tiny"), ckpt_factory("tiny-mha")
    with pytest.raises(KVLayoutError, match="kv_layout must be one of head, batch, got 'rows'"):
        load_backend("deepspeed", mqa, tp_size=2, kv_layout="rows")
    with pytest.raises(KVLayoutError, match="is for multi-query attention"):
        load_backend("deepspeed", mha, tp_size=2, kv_layout="batch")
    with pytest.raises(KVLayoutError, match="needs tp_size >= 2"):
        load_backend("deepspeed", mqa, tp_size=1, kv_layout="batch")

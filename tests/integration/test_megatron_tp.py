"""megatron-core at TP 2 in real processes (torchrun ranks over gloo): the same logits and tokens as TP 1,
a user's own script under torchrun, dist checkpoints resharded on load, and shards megatron-core's own
writer saved from two ranks read back bit-exactly."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conversion_helpers import hub_of
from megatron_upstream import add_our_meta, state_metadata
from safetensors.torch import load_file

from converters import megatron_core
from plugins.core.checkpoint import load_hf_model
from plugins.launch.launcher import RemoteBackend
from plugins.hf import HFBackend
from plugins.megatron import MegatronGPT

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-5


def real(x, mask):
    """Only positions holding tokens: HF and megatron differ (harmlessly) on padded rows."""
    return x[mask.bool()]


def hf_logits(path, ids, mask):
    return HFBackend.from_hf(path).logits(ids, mask)


@pytest.mark.parametrize("name", ["tiny", "tiny-mha"])
def test_tp2_matches_tp1(name, ckpt_factory, padded_batch):
    _, ids, mask = padded_batch
    path = ckpt_factory(name)
    tp1 = MegatronGPT.from_hf(path)
    ref_logits, ref = tp1.logits(ids, mask), tp1.generate(ids, mask, 64)
    with MegatronGPT.from_hf(path, tp_size=2) as tp2:  # plugins.launch.launcher: 2 torchrun ranks over gloo
        assert tp2.tp_size == 2 and tp2.config.n_head == 4
        assert (real(tp2.logits(ids, mask), mask) - real(ref_logits, mask)).abs().max() <= TOL
        res = tp2.generate(ids, mask, 64)
    assert torch.equal(res.tokens, ref.tokens)
    # Per rank: MQA keeps its one KV head on both ranks; MHA splits its heads.
    assert res.kv_cache_bytes == (ref.kv_cache_bytes if name == "tiny" else ref.kv_cache_bytes // 2)


TORCHRUN_SCRIPT = """
import sys, torch
from plugins.megatron import MegatronGPT
from plugins.core.tokenizer import left_pad, load_tokenizer, prompt_token_ids

if __name__ == "__main__":
    tok = load_tokenizer()
    ids, mask = left_pad([prompt_token_ids(tok, n, i) for i, n in enumerate((5, 17, 11))])
    m = MegatronGPT.from_hf(sys.argv[1], tp_size=2)
    assert isinstance(m, MegatronGPT), type(m)  # built in this rank, not through the launcher
    out = {"logits": m.logits(ids, mask), "tokens": m.generate(ids, mask, 16).tokens}
    if torch.distributed.get_rank() == 0:
        torch.save(out, sys.argv[2])
"""


def test_user_script_under_torchrun(ckpt_factory, padded_batch, tmp_path):
    _, ids, mask = padded_batch
    path = ckpt_factory("tiny")
    script = tmp_path / "user_script.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
           str(path), str(tmp_path / "out.pt")]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt")
    tp1 = MegatronGPT.from_hf(path)
    assert (real(out["logits"], mask) - real(tp1.logits(ids, mask), mask)).abs().max() <= TOL
    assert torch.equal(out["tokens"], tp1.generate(ids, mask, 16).tokens)


@pytest.mark.parametrize("save_tp,load_tp", [(1, 2), (2, 1)])
def test_dist_checkpoint_round_trip_and_reshard(save_tp, load_tp, ckpt_factory, padded_batch, tmp_path):
    _, ids, mask = padded_batch
    path = ckpt_factory("tiny")
    state = load_file(Path(path) / "model.safetensors")
    config = MegatronGPT.from_hf(path).config
    dst = tmp_path / "mcore"
    dst.mkdir()
    megatron_core.write(config, state, dst, tp_size=save_tp)
    files = {p.name for p in dst.iterdir()}
    assert {"config.json", "megatron.json", "metadata.json", "common.pt", ".metadata"} <= files
    assert [f for f in files if f.endswith(".distcp")]  # global tensors, whatever the TP they are padded for
    meta = json.loads((dst / "megatron.json").read_text())
    assert meta["tp_size"] == save_tp and meta["dtype"] == "float32" and meta["padded_vocab_size"] == 49152

    read_config, read_state = megatron_core.read(dst)
    assert read_config.to_dict() == config.to_dict()
    assert read_state.keys() == state.keys()
    assert all(torch.equal(read_state[k], state[k]) for k in state)  # bit-exact

    m = MegatronGPT.from_megatron(dst, tp_size=load_tp)
    try:
        got = m.logits(ids, mask)
    finally:
        m.close()
    assert (real(got, mask) - real(hf_logits(path, ids, mask), mask)).abs().max() <= TOL


def test_megatron_core_reader_assembles_shards_megatron_core_wrote_from_two_ranks(ckpt_factory, tmp_path):
    """TP=2 ranks of a real GPTModel save with megatron-core's own writer: every sharded tensor is in two
    chunks in two files; our reader puts them back together bit-exactly."""
    src = ckpt_factory("tiny-mha")
    dst = tmp_path / "upstream-tp2"
    dst.mkdir()
    tests = Path(__file__).resolve().parents[1]
    with RemoteBackend("megatron_upstream:UpstreamWriter", src, tp_size=2,
                       env={"PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests)])}) as ranks:
        ranks.save_upstream(str(dst))
    assert len(list(dst.glob("__1_*.distcp"))) >= 1  # rank 1 wrote its own files
    qkv = state_metadata(dst)["decoder.layers.self_attention.linear_qkv.weight"]
    assert len(qkv.chunks) == 4  # 2 layers x 2 TP shards
    add_our_meta(dst, 49152, tp_size=2)
    _, hub = megatron_core.read(dst)
    want = hub_of(load_hf_model(src))
    assert hub.keys() == want.keys() and all(torch.equal(hub[k], want[k]) for k in want)

"""Converters (converters/): the mapping table, TP split/merge, HF <-> Megatron formats, KV pooling
(bad inputs: test_converters_bad_input.py)."""

import importlib.util
import json
import os
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from conversion_helpers import assert_nothing_left, hub_of, load_rank
from megatron_upstream import COMMON_STATE, add_our_meta, state_metadata
from safetensors.torch import load_file

import converters
from converters import convert, megatron_core, megatron_legacy
from converters.mapping import ConversionError, hf_shapes, hf_to_mcore, mcore_to_hf, padded_vocab_size, pool_kv_heads
from plugins.core.checkpoint import init_model, load_hf_model
from plugins.core.config import kv_heads, load_model_config
from plugins.hf import HFBackend

_spec = importlib.util.spec_from_file_location("convert_script",
                                               Path(__file__).resolve().parents[2] / "scripts" / "convert.py")
convert_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(convert_script)
convert_cli = convert_script.main


def read_hf(d):
    return json.loads((Path(d) / "config.json").read_text()), load_file(Path(d) / "model.safetensors")


def max_logit_diff(dir_a, dir_b, batch):
    _, ids, mask = batch
    a, b = HFBackend.from_hf(dir_a), HFBackend.from_hf(dir_b)
    la, lb = a.logits(ids, mask), b.logits(ids, mask)
    n = min(la.shape[-1], lb.shape[-1])  # a padded vocab only adds columns
    keep = mask.bool()
    return (la[..., :n] - lb[..., :n])[keep].abs().max().item()


# --- the table ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name,overrides", [("tiny", {}), ("tiny-mha", {}), ("tiny", {"tie_word_embeddings": False})])
def test_table_covers_every_hf_tensor(name, overrides):
    config = load_model_config(name, **overrides)
    model = init_model(config)
    assert hf_shapes(config) == {k: tuple(v.shape) for k, v in hub_of(model).items()}


@pytest.mark.parametrize("name", ["tiny", "tiny-mha"])
def test_mcore_shards_have_gptmodel_names_and_shapes(name):
    config = load_model_config(name, tie_word_embeddings=False, vocab_size=50000)
    hub = hub_of(init_model(config))
    ranks = hf_to_mcore(hub, config, tp_size=2)
    h, d, n, g = 64, 16, 4, kv_heads(config)
    padded = padded_vocab_size(50000, 2)
    assert padded == 50176 and padded % 256 == 0
    r1 = ranks[1]
    assert r1["embedding.word_embeddings.weight"].shape == (padded // 2, h)
    assert r1["output_layer.weight"].shape == (padded // 2, h)
    assert r1["embedding.position_embeddings.weight"].shape == (256, h)
    # megatron-core splits the fused QKV evenly, even with fewer groups than ranks
    assert r1["decoder.layers.1.self_attention.linear_qkv.weight"].shape == ((n + 2 * g) * d // 2, h)
    assert r1["decoder.layers.1.self_attention.linear_proj.weight"].shape == (h, h // 2)
    assert r1["decoder.layers.1.mlp.linear_fc1.bias"].shape == (2 * h,)
    assert r1["decoder.layers.1.mlp.linear_fc2.weight"].shape == (h, 2 * h)
    assert r1["decoder.final_layernorm.weight"].shape == (h,)
    assert not any("_extra_state" in k for k in r1) and "transformer.wte.weight" not in r1
    # pad rows are zeros on the last rank; real rows are the HF embedding
    assert torch.equal(ranks[1]["embedding.word_embeddings.weight"][50000 - padded // 2:],
                       torch.zeros(padded - 50000, h))
    if g == 1:  # MQA: rank 0 holds only query rows, rank 1 the rest of the query and K, V
        assert torch.equal(torch.cat([ranks[0]["decoder.layers.0.self_attention.linear_qkv.weight"],
                                      r1["decoder.layers.0.self_attention.linear_qkv.weight"]]),
                           hub["transformer.h.0.attn.c_attn.weight"])
    for st in ranks:  # what GPTModel.state_dict() adds is ignored on the way back
        st["decoder.layers.0.self_attention.linear_qkv._extra_state"] = None
    back = mcore_to_hf(ranks, config)
    assert back.keys() == hub.keys() and all(torch.equal(back[k], hub[k]) for k in hub)


def test_tied_config_has_no_output_layer():
    config = load_model_config("tiny")
    ranks = hf_to_mcore(hub_of(init_model(config)), config, tp_size=1)
    assert "output_layer.weight" not in ranks[0]
    assert ranks[0]["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (96, 64)


# --- Megatron-LM legacy ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny", "tiny-mha"])
def test_legacy_tp2_round_trip_is_bit_exact(name, ckpt_factory, tmp_path, padded_batch):
    src = ckpt_factory(name)
    s = convert(src, tmp_path / "legacy", "hf", "megatron-legacy", tp_size=2)
    assert s["tensors"] == len(hf_shapes(load_model_config(name))) and s["bytes"] > 0
    assert (tmp_path / "legacy" / "latest_checkpointed_iteration.txt").read_text() == "release"
    ck0, ck1 = load_rank(tmp_path / "legacy", 0), load_rank(tmp_path / "legacy", 1)
    assert ck0["checkpoint_version"] == 3.0 and isinstance(ck0["args"], Namespace)
    assert ck0["args"].tensor_model_parallel_size == 2 and ck0["args"].padded_vocab_size == 49152
    enc0, enc1 = ck0["model"]["language_model"]["encoder"], ck1["model"]["language_model"]["encoder"]
    assert ck1["model"]["language_model"]["embedding"]["word_embeddings"]["weight"].shape == (49152 // 2, 64)
    qkv = load_file(Path(src) / "model.safetensors")["transformer.h.0.attn.c_attn.weight"]
    if name == "tiny":  # each rank: its 2 query heads + the one K/V head, replicated
        for r, enc in enumerate((enc0, enc1)):
            assert torch.equal(enc["layers.0.self_attention.query_key_value.weight"],
                               torch.cat([qkv[r * 32:(r + 1) * 32], qkv[64:]]))
    else:  # per-head [q, k, v]: whole heads per rank
        assert torch.equal(enc1["layers.0.self_attention.query_key_value.weight"], qkv[96:])
    assert enc1["layers.0.self_attention.dense.weight"].shape == (64, 32)
    assert enc1["layers.0.mlp.dense_4h_to_h.weight"].shape == (64, 128)

    convert(tmp_path / "legacy", tmp_path / "back", "megatron-legacy", "hf")
    (cfg_a, w_a), (cfg_b, w_b) = read_hf(src), read_hf(tmp_path / "back")
    assert cfg_a == cfg_b
    assert w_a.keys() == w_b.keys() and all(torch.equal(w_a[k], w_b[k]) for k in w_a)
    assert max_logit_diff(src, tmp_path / "back", padded_batch) == 0.0


def test_legacy_untied_padded_vocab_and_dtype(ckpt_factory, tmp_path):
    src = ckpt_factory("tiny", tie_word_embeddings=False, vocab_size=50000)
    convert(src, tmp_path / "legacy", "hf", "megatron-legacy", tp_size=4, dtype="bfloat16")
    ck = load_rank(tmp_path / "legacy", 3)
    assert ck["args"].padded_vocab_size == 50176  # multiple of 128 * 4
    lm = ck["model"]["language_model"]
    assert lm["output_layer"]["weight"].shape == (50176 // 4, 64) and \
        lm["output_layer"]["weight"].dtype == torch.bfloat16
    convert(tmp_path / "legacy", tmp_path / "back", "megatron-legacy", "hf")
    _, w = read_hf(tmp_path / "back")
    _, w0 = read_hf(src)
    assert w["lm_head.weight"].shape == (50000, 64)
    assert all(torch.equal(w[k], w0[k].to(torch.bfloat16)) for k in w0)


# --- MHA -> MQA / GQA -----------------------------------------------------------------------------

def test_mha_to_mqa_loads_and_runs_in_hf(ckpt_factory, tmp_path, padded_batch):
    src = ckpt_factory("tiny-mha")
    convert(src, tmp_path / "mqa", "hf", "hf", kv_heads=1)
    _, w0 = read_hf(src)
    _, w1 = read_hf(tmp_path / "mqa")
    per_head = w0["transformer.h.0.attn.c_attn.weight"].view(4, 3, 16, 64)
    c_attn = w1["transformer.h.0.attn.c_attn.weight"]
    assert c_attn.shape == (64 + 2 * 16, 64)
    assert torch.equal(c_attn[:64], per_head[:, 0].reshape(64, 64))  # queries untouched
    torch.testing.assert_close(c_attn[64:80], per_head[:, 1].mean(0))  # K: mean of the 4 heads
    torch.testing.assert_close(c_attn[80:], per_head[:, 2].mean(0))
    backend = HFBackend.from_hf(tmp_path / "mqa")
    assert backend.model.config.multi_query
    _, ids, mask = padded_batch
    assert torch.isfinite(backend.logits(ids, mask)).all()
    out = backend.generate(ids, mask, max_new_tokens=4)
    assert out.tokens.shape == (3, ids.shape[1] + 4)


def test_mha_to_gqa_is_megatron_only(ckpt_factory, tmp_path):
    src = ckpt_factory("tiny-mha")
    with pytest.raises(ConversionError, match="only MQA .* or MHA"):
        convert(src, tmp_path / "hf", "hf", "hf", kv_heads=2)
    assert_nothing_left(tmp_path / "hf")
    convert(src, tmp_path / "gqa", "hf", "megatron-legacy", tp_size=2, kv_heads=2)
    ck = load_rank(tmp_path / "gqa", 1)
    assert ck["args"].group_query_attention and ck["args"].num_query_groups == 2
    # one group per rank: [2 query heads | k | v]
    assert ck["model"]["language_model"]["encoder"]["layers.0.self_attention.query_key_value.weight"].shape == (64, 64)
    config, hub = megatron_legacy.read(tmp_path / "gqa")
    assert kv_heads(config) == 2 and hub["transformer.h.0.attn.c_attn.weight"].shape == (128, 64)
    with pytest.raises(ConversionError, match="only MQA"):
        convert(tmp_path / "gqa", tmp_path / "hf", "megatron-legacy", "hf")
    # GQA -> MQA pools further and is HF again
    config1, hub1 = pool_kv_heads(hub, config, 1)
    assert config1.multi_query and hub1["transformer.h.0.attn.c_attn.weight"].shape == (96, 64)


# --- megatron-core dist checkpoint (converters/megatron_core.py) ---------------------------------

def test_megatron_core_round_trip_is_bit_exact(ckpt_factory, tmp_path, padded_batch):
    """HF -> megatron (TP=2, MQA: fewer KV heads than ranks) -> HF; MHA shards are covered in memory above."""
    src = ckpt_factory("tiny")
    convert(src, tmp_path / "mcore", "hf", "megatron", tp_size=2)
    convert(tmp_path / "mcore", tmp_path / "back", "megatron", "hf")
    (_, w_a), (_, w_b) = read_hf(src), read_hf(tmp_path / "back")
    assert w_a.keys() == w_b.keys() and all(torch.equal(w_a[k], w_b[k]) for k in w_a)
    assert max_logit_diff(src, tmp_path / "back", padded_batch) == 0.0


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": False, "vocab_size": 50000}], ids=["tied", "untied"])
def test_megatron_core_files_are_what_megatron_core_saves_and_loads(overrides, ckpt_factory, tmp_path, padded_batch):
    """Our writer makes the same tensors and objects megatron-core's own save makes for the same GPTModel,
    megatron-core's own loader loads them strictly, and our reader reads upstream's files bit-exactly."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from megatron_upstream import save_upstream_in_process

    from plugins.megatron import MegatronGPT
    from plugins.megatron.model import build_model

    src = ckpt_factory("tiny", **overrides)
    convert(src, tmp_path / "ours", "hf", "megatron")
    ref = MegatronGPT.from_hf(src)
    (tmp_path / "upstream").mkdir()
    save_upstream_in_process(ref.model, ref.config, tmp_path / "upstream")
    ours, upstream = state_metadata(tmp_path / "ours"), state_metadata(tmp_path / "upstream")
    assert ours.keys() == upstream.keys() - {COMMON_STATE}  # megatron-core >= 0.19 keeps its common dict in there
    for key, md in upstream.items():
        assert type(ours[key]) is type(md), key
        if hasattr(md, "size"):
            assert ours[key].size == md.size and ours[key].properties.dtype == md.properties.dtype, key

    fresh = build_model(ref.config, 1)
    loaded = dist_checkpointing.load(fresh.sharded_state_dict(), str(tmp_path / "ours"),
                                     strict=StrictHandling.RAISE_ALL)
    fresh.load_state_dict(loaded)
    _, ids, mask = padded_batch
    assert torch.equal(MegatronGPT(fresh, ref.config, torch.float32, 1).logits(ids, mask), ref.logits(ids, mask))

    add_our_meta(tmp_path / "upstream", fresh.embedding.word_embeddings.weight.shape[0])
    config, hub = megatron_core.read(tmp_path / "upstream")
    want = hub_of(load_hf_model(src))
    assert hub.keys() == want.keys() and all(torch.equal(hub[k], want[k]) for k in want)


def test_megatron_core_019_checkpoint_converts_to_hf(ckpt_factory, tmp_path, padded_batch):
    """A GPTModel saved the way megatron-core 0.19 saves (no common.pt: the common state is the 'common_state'
    object inside; metadata.json without common_backend) loads back strictly the way 0.19 loads, converts to HF
    bit-exactly, and differs from our writer's output only by that object."""
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from megatron_upstream import CONFIG_019, load_like_megatron_core_019, save_like_megatron_core_019
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from plugins.megatron import MegatronGPT
    from plugins.megatron.model import build_model

    src = ckpt_factory("tiny")
    ref = MegatronGPT.from_hf(src)
    d = tmp_path / "mcore-0.19"
    d.mkdir()
    save_like_megatron_core_019(ref.model.sharded_state_dict(), d)
    assert not (d / "common.pt").exists() and json.loads((d / "metadata.json").read_text()) == CONFIG_019
    metadata = state_metadata(d)
    assert isinstance(metadata[COMMON_STATE], BytesStorageMetadata)
    fresh = build_model(ref.config, 1)
    loaded = load_like_megatron_core_019(fresh.sharded_state_dict(), d, StrictHandling.RAISE_ALL)
    fresh.load_state_dict(loaded)
    _, ids, mask = padded_batch
    assert torch.equal(MegatronGPT(fresh, ref.config, torch.float32, 1).logits(ids, mask), ref.logits(ids, mask))

    ref.config.to_json_file(d / "config.json")  # what our writer adds beside megatron-core's files
    add_our_meta(d, fresh.embedding.word_embeddings.weight.shape[0])
    convert(d, tmp_path / "hf", "megatron", "hf")
    (_, w_a), (_, w_b) = read_hf(src), read_hf(tmp_path / "hf")
    assert w_a.keys() == w_b.keys() and all(torch.equal(w_a[k], w_b[k]) for k in w_a)
    convert(src, tmp_path / "ours", "hf", "megatron")
    assert state_metadata(tmp_path / "ours").keys() == metadata.keys() - {COMMON_STATE}


def test_megatron_core_metadata_pickle_cannot_run_code(ckpt_factory, tmp_path):
    """A planted `.metadata` whose pickle would run a command: refused, the command never runs."""
    import pickle

    convert(ckpt_factory("tiny"), tmp_path / "ckpt", "hf", "megatron")
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(Payload()))
    for call in (lambda: megatron_core.read(tmp_path / "ckpt"),
                 lambda: convert(tmp_path / "ckpt", tmp_path / "out", "megatron", "hf")):
        with pytest.raises(ConversionError, match="refusing to load (posix|os).system"):
            call()
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_float16_storage_works_on_cpu(ckpt_factory, tmp_path):
    """Refusing fp16 compute on CPU is right; a conversion only casts, so fp16 files are fine."""
    convert(ckpt_factory("tiny"), tmp_path / "fp16", "hf", "hf", dtype="float16")
    w = read_hf(tmp_path / "fp16")[1]
    assert all(t.dtype == torch.float16 for t in w.values())
    convert(tmp_path / "fp16", tmp_path / "l", "hf", "megatron-legacy", tp_size=2)
    assert load_rank(tmp_path / "l", 0)["args"].fp16


# --- CLI ------------------------------------------------------------------------------------------

def test_cli_converts_and_reports(ckpt_factory, tmp_path, capsys):
    src = ckpt_factory("tiny")
    assert convert_cli(["--from", "hf", "--to", "megatron-legacy", "--tp", "2", "--quiet", str(src),
                        str(tmp_path / "l")]) == 0
    out = capsys.readouterr().out
    assert "hf -> megatron-legacy (tp_size=2, pp_size=1, kv_heads=1): 28 tensors" in out and "MB written" in out
    assert convert_cli(["--from", "megatron-legacy", "--to", "hf", str(tmp_path / "l"), str(tmp_path / "l")]) == 2
    assert "is SRC" in capsys.readouterr().err
    assert convert_cli(["--from", "hf", "--to", "hf", str(src), str(tmp_path / "l")]) == 2
    assert "already exists" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        convert_cli(["--help"])
    assert "Examples:" in capsys.readouterr().out


def test_mha_to_mqa_and_gqa_write_as_megatron_core(ckpt_factory, tmp_path):
    mcore = converters.format_module("megatron", write=True)
    src = ckpt_factory("tiny-mha")
    config0, hub0 = converters.format_module("hf").read(src)
    for groups in (1, 2):
        convert(src, tmp_path / f"g{groups}", "hf", "megatron", kv_heads=groups)
        config, hub = mcore.read(tmp_path / f"g{groups}")
        want_config, want = pool_kv_heads(hub0, config0, groups)
        assert kv_heads(config) == groups and config.multi_query == (groups == 1)
        assert all(torch.equal(hub[k], want[k]) for k in want)

"""Converters given bad inputs: one clear error naming the problem, before any work, and nothing left behind."""

import os
from pathlib import Path

import pytest
import torch
from conversion_helpers import assert_nothing_left, load_rank
from safetensors.torch import load_file, save_file

from converters import convert, megatron_core, megatron_legacy
from converters.mapping import ConversionError
from plugins.core.config import ConfigError


def edit_safetensors(d, fn):
    f = Path(d) / "model.safetensors"
    w = load_file(f)
    fn(w)
    save_file(w, f)


def edit_rank(d, rank, fn):
    f = Path(d) / "release" / f"mp_rank_{rank:02d}" / "model_optim_rng.pt"
    ck = load_rank(d, rank)
    fn(ck["model"]["language_model"]["encoder"])
    torch.save(ck, f)


def corrupt(kind, d):
    if kind == "hf-truncated":
        f = Path(d) / "model.safetensors"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif kind == "hf-garbage":
        (Path(d) / "model.safetensors").write_bytes(b"not a safetensors file")
    elif kind == "hf-missing-key":
        edit_safetensors(d, lambda w: w.pop("transformer.h.1.mlp.c_fc.bias"))
    elif kind == "hf-extra-key":
        edit_safetensors(d, lambda w: w.update({"transformer.h.2.ln_1.weight": torch.ones(64)}))
    elif kind == "hf-shape":
        edit_safetensors(d, lambda w: w.update({"transformer.h.0.ln_2.bias": torch.ones(65)}))
    elif kind == "legacy-truncated":
        f = Path(d) / "release" / "mp_rank_01" / "model_optim_rng.pt"
        f.write_bytes(f.read_bytes()[:1000])
    elif kind == "legacy-missing-key":
        edit_rank(d, 1, lambda e: e.pop("layers.0.mlp.dense_h_to_4h.weight"))
    elif kind == "legacy-extra-key":
        edit_rank(d, 0, lambda e: e.update({"layers.0.self_attention.rotary.inv_freq": torch.ones(8)}))
    elif kind == "legacy-shape":
        edit_rank(d, 1, lambda e: e.update({"layers.1.self_attention.dense.weight": torch.ones(64, 64)}))
    elif kind == "legacy-kv-differs":
        edit_rank(d, 1, lambda e: e["layers.0.self_attention.query_key_value.weight"][-1].add_(1.0))
    elif kind == "legacy-layernorm-differs":
        edit_rank(d, 1, lambda e: e["layers.1.input_layernorm.weight"].add_(1.0))


BAD = [  # (corruption, message)
    ("hf-truncated", "cannot read"),
    ("hf-garbage", "cannot read"),
    ("hf-missing-key", r"missing \['transformer.h.1.mlp.c_fc.bias'\]"),
    ("hf-extra-key", r"unexpected \['transformer.h.2.ln_1.weight'\]"),
    ("hf-shape", r"transformer.h.0.ln_2.bias has shape \(65,\), config.json says \(64,\)"),
    ("legacy-truncated", r"cannot read .*mp_rank_01"),
    ("legacy-missing-key", "TP rank 1: missing 1 tensor.*layers.0.mlp.dense_h_to_4h.weight"),
    ("legacy-extra-key", "TP rank 0: 1 unexpected tensor.*rotary"),
    ("legacy-shape", r"TP rank 1: .*layers.1.self_attention.dense.weight has shape \(64, 64\), expected \(64, 32\)"),
    # MQA at TP=2 is stored as 2 identical K/V groups (NVIDIA's layout); copies that differ are 2 real KV heads
    ("legacy-kv-differs", r"supports only MQA \(1 KV head\) or MHA \(4 KV heads\), not 2 KV heads"),
    ("legacy-layernorm-differs",
     r"layers.1.input_layernorm.weight: replicated tensor differs between TP ranks 0 and 1"),
]


@pytest.mark.parametrize("kind,message", BAD, ids=[b[0] for b in BAD])
def test_bad_checkpoint_gives_one_clear_error(kind, message, ckpt_factory, tmp_path):
    src = ckpt_factory("tiny")
    if kind.startswith("hf"):
        src_dir, fmt = tmp_path / "src", "hf"
        convert(src, src_dir, "hf", "hf")
    else:
        src_dir, fmt = tmp_path / "src", "megatron-legacy"
        convert(src, src_dir, "hf", "megatron-legacy", tp_size=2)
    corrupt(kind, src_dir)
    dst_format = "megatron-legacy" if fmt == "hf" else "hf"
    with pytest.raises(ConversionError, match=message):
        convert(src_dir, tmp_path / "dst", fmt, dst_format)
    assert_nothing_left(tmp_path / "dst")


@pytest.mark.parametrize("kwargs,message", [
    (dict(src_format="hf", dst_format="megatron-legacy", tp_size=3), "tp_size 3 does not divide n_head 4"),
    (dict(src_format="hf", dst_format="hf", tp_size=2), "HF format has no tensor parallelism"),
    (dict(src_format="safetensors", dst_format="hf"), "unknown input format 'safetensors'"),
    (dict(src_format="hf", dst_format="gguf"), "unknown output format 'gguf'"),
    (dict(src_format="hf", dst_format="hf", pp_size=2), "format 'hf' has no pipeline stages"),
    (dict(src_format="hf", dst_format="megatron-legacy", pp_size=3), "pp_size 3 does not divide n_layer 2"),
    (dict(src_format="hf", dst_format="megatron", iteration=5), "format 'hf' has no iterations"),
    (dict(src_format="megatron-legacy", dst_format="hf"), "not a Megatron-LM checkpoint"),
    (dict(src_format="hf", dst_format="hf", kv_heads=3), "kv_heads=3"),
    (dict(src_format="hf", dst_format="hf", dtype="float8"), "unknown dtype"),
])
def test_bad_request_gives_one_clear_error(kwargs, message, ckpt_factory, tmp_path):
    with pytest.raises(ConfigError, match=message):
        convert(ckpt_factory("tiny"), tmp_path / "dst", **kwargs)
    assert_nothing_left(tmp_path / "dst")


def test_existing_dst_needs_force_and_force_replaces_only_a_checkpoint(ckpt_factory, tmp_path):
    dst = tmp_path / "dst"
    convert(ckpt_factory("tiny"), dst, "hf", "hf")
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match="already exists"):
        convert(ckpt_factory("tiny"), dst, "hf", "megatron-legacy")
    assert (dst / "keep.txt").read_text() == "mine"
    convert(ckpt_factory("tiny"), dst, "hf", "megatron-legacy", force=True)
    assert not (dst / "keep.txt").exists() and (dst / "latest_checkpointed_iteration.txt").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match="not a checkpoint directory"):
        convert(ckpt_factory("tiny"), mine, "hf", "megatron-legacy", force=True)
    assert (mine / "keep.txt").read_text() == "mine"


def test_failed_verification_leaves_nothing(ckpt_factory, tmp_path, monkeypatch):
    real_read = megatron_legacy.read

    def flipped_read(src, progress=None):  # a writer bug: one value does not read back
        config, hub = real_read(src)
        hub["transformer.h.1.ln_1.bias"] = hub["transformer.h.1.ln_1.bias"] + 1
        return config, hub

    monkeypatch.setattr(megatron_legacy, "read", flipped_read)
    with pytest.raises(ConversionError, match="verification failed: transformer.h.1.ln_1.bias"):
        convert(ckpt_factory("tiny"), tmp_path / "dst", "hf", "megatron-legacy", tp_size=2)
    assert_nothing_left(tmp_path / "dst")


def _megatron_core(ckpt_factory, tmp_path):
    convert(ckpt_factory("tiny"), tmp_path / "mcore", "hf", "megatron")
    return tmp_path / "mcore"


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "megatron.json").write_text("{oops"), "megatron.json or metadata.json is not valid JSON"),
    (lambda d: (d / "megatron.json").write_text('{"padded_vocab_size": "big"}'), "integer padded_vocab_size"),
    (lambda d: (d / ".metadata").unlink(), "no .metadata"),
    (lambda d: (d / ".metadata").write_bytes(b"\x80\x04garbage"), "cannot read .*.metadata"),
    (lambda d: (d / "config.json").write_text((d / "config.json").read_text().replace('"n_embd": 64', '"n_embd": 63')),
     r"n_embd \(63\) is not divisible"),
    (lambda d: [f.write_bytes(f.read_bytes()[:100]) for f in d.glob("*.distcp")], "lies outside|truncated"),
])
def test_broken_megatron_core_checkpoint_is_one_clear_error(damage, message, ckpt_factory, tmp_path):
    src = _megatron_core(ckpt_factory, tmp_path)
    damage(src)
    with pytest.raises(ConversionError, match=message):
        convert(src, tmp_path / "hf", "megatron", "hf")
    assert_nothing_left(tmp_path / "hf")


def test_megatron_core_extra_state_objects_are_never_unpickled(ckpt_factory, tmp_path):
    """megatron-core loads `_extra_state` objects with weights_only=False; we never read them, so a payload
    planted there does not run."""
    import torch.distributed.checkpoint as dcp

    from converters.mapping import hf_to_megatron
    from converters.megatron_core import dist_tensors

    src = _megatron_core(ckpt_factory, tmp_path)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    config, hub = megatron_core.read(src)
    tensors = dist_tensors(hf_to_megatron(hub, config, "mcore", 1, 49152)[0], config.n_layer)
    objects = {f"decoder.layers.{m}._extra_state/shard_{i}_2": Payload() for m in megatron_core.EXTRA_STATE
               for i in range(2)}
    for f in [*src.glob("*.distcp"), src / ".metadata"]:
        f.unlink()
    dcp.save({**tensors, **objects}, storage_writer=dcp.FileSystemWriter(str(src), thread_count=1),
             planner=dcp.DefaultSavePlanner(flatten_state_dict=False), no_dist=True)
    _, read_back = megatron_core.read(src)
    assert all(torch.equal(read_back[k], hub[k]) for k in hub)
    assert not marker.exists()


@pytest.mark.parametrize("edit, message", [
    (lambda a: delattr(a, "hidden_size"), "args.hidden_size must be a positive integer, got None"),
    (lambda a: setattr(a, "num_attention_heads", 0), "args.num_attention_heads must be a positive integer, got 0"),
    (lambda a: setattr(a, "num_layers", "2"), "args.num_layers must be a positive integer"),
    (lambda a: setattr(a, "tensor_model_parallel_size", None), "args.tensor_model_parallel_size"),
])
def test_malformed_legacy_args_are_one_clear_error(edit, message, ckpt_factory, tmp_path):
    convert(ckpt_factory("tiny"), tmp_path / "l", "hf", "megatron-legacy")
    f = tmp_path / "l" / "release" / "mp_rank_00" / "model_optim_rng.pt"
    ck = load_rank(tmp_path / "l", 0)
    edit(ck["args"])
    torch.save(ck, f)
    with pytest.raises(ConversionError, match=message):
        convert(tmp_path / "l", tmp_path / "hf", "megatron-legacy", "hf")
    assert_nothing_left(tmp_path / "hf")


def test_bad_tracker_file_is_one_clear_error(ckpt_factory, tmp_path):
    convert(ckpt_factory("tiny"), tmp_path / "l", "hf", "megatron-legacy")
    (tmp_path / "l" / "latest_checkpointed_iteration.txt").write_text("last Tuesday")
    with pytest.raises(ConversionError, match="expected 'release' or an iteration number"):
        convert(tmp_path / "l", tmp_path / "hf", "megatron-legacy", "hf")
    (tmp_path / "l" / "latest_checkpointed_iteration.txt").write_text("300")
    with pytest.raises(ConversionError, match="names '300' but iter_0000300/ is missing"):
        convert(tmp_path / "l", tmp_path / "hf", "megatron-legacy", "hf")


def test_nan_weights_are_named_not_blamed_on_the_read_back(ckpt_factory, tmp_path):
    import shutil

    shutil.copytree(ckpt_factory("tiny"), tmp_path / "src")
    edit_safetensors(tmp_path / "src",
                     lambda w: w["transformer.h.1.attn.c_proj.weight"].__setitem__((0, 0), float("nan")))
    with pytest.raises(ConversionError, match="transformer.h.1.attn.c_proj.weight holds NaN or infinite values"):
        convert(tmp_path / "src", tmp_path / "out", "hf", "megatron-legacy")
    assert_nothing_left(tmp_path / "out")



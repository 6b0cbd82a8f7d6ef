"""Megatron-LM `--ckpt-format torch` checkpoints of the megatron-core GPT model (converters/megatron_torch.py):
TP x PP round trips, each rank's file loaded strictly into a real GPTModel (its logits against HF), TP=2 shards
against a GPTModel megatron-core sizes at TP=2, the Transformer Engine names, and a file as Megatron-LM's
training writes it (TP=2 ranks in real processes: tests/integration/test_megatron_torch_tp.py)."""

import os
import random
from argparse import Namespace
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from conversion_helpers import hub_of
from megatron_upstream import chained_logits, load_rank_files
from safetensors.torch import load_file

from converters import consumers, convert, megatron_torch
from converters import hf as hf_format
from converters.mapping import ConversionError, hf_to_mcore, pool_kv_heads
from converters.stages import FILE, rank_dir
from plugins.core.checkpoint import load_hf_model
from plugins.core.config import kv_heads, load_model_config
from plugins.hf import HFBackend
from plugins.megatron import MegatronGPT
from plugins.megatron.model import init_parallel

TOL = 1e-5
# Every args field Megatron-LM's checkpointing.py reads from a checkpoint's args (check_checkpoint_args,
# load_args_from_checkpoint, load_checkpoint; NVIDIA/Megatron-LM d98e8a64), for a dense GPT model:
CHECK_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "add_position_embedding", "max_position_embeddings",
              "make_vocab_size_divisible_by", "padded_vocab_size", "tokenizer_type", "tensor_model_parallel_size",
              "pipeline_model_parallel_size")
LOAD_ARGS = ("ffn_hidden_size", "seq_length", "num_query_groups", "group_query_attention", "kv_channels",
             "position_embedding_type", "add_position_embedding", "use_rotary_position_embeddings", "rotary_base",
             "rotary_percent", "rotary_interleaved", "add_bias_linear", "add_qkv_bias", "squared_relu", "swiglu",
             "untie_embeddings_and_output_weights", "apply_layernorm_1p", "normalization",
             "apply_query_key_layer_scaling", "attention_dropout", "hidden_dropout", "spec", "num_experts",
             "ckpt_format", "virtual_pipeline_model_parallel_size", "consumed_train_samples", "consumed_valid_samples",
             "world_size", "data_parallel_size", "no_save_rng", "no_save_optim", "transformer_impl")


def stage_file(d, tp, pp, pp_size, it="release"):
    return rank_dir(Path(d) / it, tp, pp, pp_size) / FILE


def load(f):
    from megatron.core.safe_globals import register_safe_globals

    register_safe_globals()
    return torch.load(f, map_location="cpu", weights_only=True)  # what Megatron-LM's load_checkpoint does


def read_hf(d):
    return load_file(Path(d) / "model.safetensors")


def same_weights(a, b):
    wa, wb = read_hf(a), read_hf(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("spec", ["local", "te"])
@pytest.mark.parametrize("name", ["tiny", "tiny-mha"])
def test_tp2_pp2_round_trip_is_bit_exact(name, spec, ckpt_factory, tmp_path):
    src = ckpt_factory(name, n_layer=4)
    convert(src, tmp_path / "t", "hf", "megatron-torch", tp_size=2, pp_size=2, layer_spec=spec)
    assert (tmp_path / "t" / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert sorted(p.name for p in (tmp_path / "t" / "release").iterdir()) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    ck = load(stage_file(tmp_path / "t", 1, 1, 2))
    assert set(ck) == {"args", "checkpoint_version", "iteration", "model", "num_floating_point_operations_so_far",
                       "hf_config"}  # --no-save-optim --no-save-rng, as tools/checkpoint's saver writes
    assert ck["checkpoint_version"] == 3.0 and ck["iteration"] == 0 and isinstance(ck["model"], OrderedDict)
    model = ck["model"]
    norm = "self_attention.linear_qkv.layer_norm_weight" if spec == "te" else "input_layernorm.weight"
    assert f"decoder.layers.1.{norm}" in model and "decoder.layers.2.mlp.linear_fc1.bias" not in model  # local index
    assert "embedding.word_embeddings.weight" not in model and "decoder.final_layernorm.weight" in model
    assert torch.equal(model["output_layer.weight"],  # the tied head's copy: the first stage's embedding shard
                       load(stage_file(tmp_path / "t", 1, 0, 2))["model"]["embedding.word_embeddings.weight"])
    extra = model["decoder.layers.0.mlp.linear_fc2._extra_state"]
    config = load_hf_model(src).config  # the keys of that rank and stage's model (TE: derived, see consumers.py)
    assert model.keys() == consumers.mcore_state_keys(config, 49152, spec, 2, 1, 2, False, True).keys()
    if spec == "te":  # what Transformer Engine modules save without FP8
        assert extra.dtype == torch.uint8 and extra.numel() == 0 and "input_layernorm" not in str(list(model))
        assert model["decoder.layers.0.self_attention.core_attention._extra_state"].numel() == 0
        assert model["decoder.final_layernorm._extra_state"].numel() == 0
    else:
        assert extra is None and not any("core_attention" in k for k in model)
    assert model["output_layer._extra_state"] is None
    args = ck["args"]
    assert args.transformer_impl == ("transformer_engine" if spec == "te" else "local") and args.ckpt_format == "torch"
    assert args.num_query_groups == kv_heads(load_model_config(name))  # megatron-core: no K/V duplication
    convert(tmp_path / "t", tmp_path / "back", "megatron-torch", "hf")
    assert same_weights(src, tmp_path / "back")


def test_written_args_carry_what_megatron_lm_reads(ckpt_factory, tmp_path):
    convert(ckpt_factory("tiny"), tmp_path / "t", "hf", "megatron-torch", tp_size=2, dtype="bfloat16")
    args = load(stage_file(tmp_path / "t", 0, 0, 1))["args"]
    missing = [a for a in CHECK_ARGS + LOAD_ARGS if not hasattr(args, a)]
    assert not missing
    assert args.bf16 and args.params_dtype == torch.bfloat16 and args.position_embedding_type == "learned_absolute"
    assert args.group_query_attention and args.num_query_groups == 1 and args.bias_gelu_fusion  # tanh GELU


@pytest.mark.parametrize("name", ["tiny", "tiny-mha"])
def test_tp1_file_loads_strictly_into_gptmodel_and_matches_hf(name, ckpt_factory, tmp_path, padded_batch):
    """The TP=1 file into megatron-core's GPTModel (local spec) with load_state_dict(strict=True): HF's logits."""
    src = ckpt_factory(name)
    convert(src, tmp_path / "t", "hf", "megatron-torch")
    init_parallel(1)
    config = load_hf_model(src).config
    _, ids, mask = padded_batch
    got = chained_logits(load_rank_files(tmp_path / "t", config), ids, mask, config.vocab_size)
    ref = HFBackend.from_hf(src).logits(ids, mask)
    diff = (got - ref)[mask.bool()].abs().max().item()
    assert diff <= TOL, diff


def test_pp2_stage_files_load_strictly_into_stage_models_and_chain(ckpt_factory, tmp_path, padded_batch):
    """PP=2 (tied): each stage file into its stage's GPTModel, strictly; the stages chained give HF's logits."""
    src = ckpt_factory("tiny", n_layer=4)
    convert(src, tmp_path / "t", "hf", "megatron-torch", pp_size=2)
    init_parallel(1)
    config = load_hf_model(src).config
    stages = load_rank_files(tmp_path / "t", config)
    assert [len(m.decoder.layers) for m in stages] == [2, 2] and stages[1].output_layer.weight is not None
    _, ids, mask = padded_batch
    got = chained_logits(stages, ids, mask, config.vocab_size)
    ref = HFBackend.from_hf(src).logits(ids, mask)
    assert (got - ref)[mask.bool()].abs().max().item() <= TOL


@pytest.mark.parametrize("name", ["tiny", "tiny-mha"])
def test_tp2_shards_are_what_gptmodel_at_tp2_holds(name, ckpt_factory, tmp_path):
    """Each TP=2 file: the keys and shapes of the GPTModel megatron-core builds for that rank at TP=2 (on meta,
    its own shard sizes), and the shards are the mapping's split of the HF weights."""
    src = ckpt_factory(name, tie_word_embeddings=False, vocab_size=50000)
    convert(src, tmp_path / "t", "hf", "megatron-torch", tp_size=2)
    config = load_hf_model(src).config
    split = hf_to_mcore(hub_of(load_hf_model(src)), config, tp_size=2)
    for r in (0, 1):
        model = load(stage_file(tmp_path / "t", r, 0, 1))["model"]
        built, _ = consumers.gptmodel(config, 50176, tp=2, tp_rank=r)
        want = built.state_dict()
        assert model.keys() == want.keys()
        for k, v in want.items():
            assert (None if v is None else v.shape) == (None if model[k] is None else model[k].shape), k
        assert model["decoder.layers.0.self_attention.linear_qkv.weight"].shape[0] == (
            (4 + 2 * kv_heads(config)) * 16 // 2)  # megatron-core splits the fused QKV evenly
        assert all(torch.equal(model[k], t) for k, t in split[r].items())


def test_gqa_with_fewer_groups_than_ranks_round_trips(ckpt_factory, tmp_path):
    """MHA pooled to 2 KV groups at TP=4 x PP=2: megatron-core shards the fused QKV evenly, no duplication."""
    src = ckpt_factory("tiny-mha", n_head=8, n_layer=2)
    convert(src, tmp_path / "t", "hf", "megatron-torch", tp_size=4, pp_size=2, kv_heads=2, layer_spec="te")
    args = load(stage_file(tmp_path / "t", 3, 1, 2))["args"]
    assert args.num_query_groups == 2 and args.group_query_attention
    config, hub = megatron_torch.read(tmp_path / "t")
    config0, hub0 = hf_format.read(src)
    _, hub0 = pool_kv_heads(hub0, config0, 2)
    assert kv_heads(config) == 2 and hub.keys() == hub0.keys() and all(torch.equal(hub[k], hub0[k]) for k in hub0)


def test_training_checkpoint_as_megatron_lm_writes_it(ckpt_factory, tmp_path):
    """iter_0001000 as Megatron-LM's save_checkpoint writes it from a GPTModel: `state_dict_for_save_checkpoint()`
    (= state_dict(), _extra_state included), optimizer, scheduler and RNG state (numpy state, generators), its
    own args (no hf_config): read as weights, config from args (the padded vocabulary, tanh GELU from the
    bias-GELU fusion)."""
    src = ckpt_factory("tiny")
    ref = MegatronGPT.from_hf(src)
    state = ref.model.state_dict()
    assert state["decoder.layers.0.self_attention.linear_qkv._extra_state"] is None
    args = Namespace(num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, kv_channels=16,
                     group_query_attention=True, num_query_groups=1, max_position_embeddings=256, seq_length=256,
                     padded_vocab_size=49152, position_embedding_type="learned_absolute", normalization="LayerNorm",
                     add_bias_linear=True, swiglu=False, bias_gelu_fusion=True,
                     untie_embeddings_and_output_weights=False,
                     layernorm_epsilon=1e-5, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                     transformer_impl="local", ckpt_format="torch", params_dtype=torch.float32)
    gen = torch.Generator()
    gen.manual_seed(1)
    rng = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.zeros(16, dtype=torch.uint8),
            "rng_tracker_states": {"model-parallel-rng": gen}}]
    d = tmp_path / "run" / "iter_0001000" / "mp_rank_00"
    d.mkdir(parents=True)
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 1000, "model": state,
                "optimizer": {"state": {}, "param_groups": [{"lr": 1e-4, "params": [0]}]},
                "opt_param_scheduler": {"num_steps": 1000}, "rng_state": rng,
                "num_floating_point_operations_so_far": 1.5e15}, d / FILE)
    (tmp_path / "run" / "latest_checkpointed_iteration.txt").write_text("1000")
    convert(tmp_path / "run", tmp_path / "hf", "megatron-torch", "hf")
    assert same_weights(src, tmp_path / "hf")


def test_reading_the_wrong_format_is_one_clear_error(ckpt_factory, tmp_path):
    convert(ckpt_factory("tiny"), tmp_path / "legacy", "hf", "megatron-legacy")
    with pytest.raises(ConversionError,
                       match="not a megatron-core GPT model's state dict .*read it as megatron-legacy"):
        convert(tmp_path / "legacy", tmp_path / "hf", "megatron-torch", "hf")
    with pytest.raises(ConversionError, match="layer_spec must be one of local, te"):
        convert(ckpt_factory("tiny"), tmp_path / "x", "hf", "megatron-torch", layer_spec="transformer_engine")
    with pytest.raises(ConversionError, match="no layer spec choice"):
        convert(ckpt_factory("tiny"), tmp_path / "x", "hf", "megatron", layer_spec="te")
    assert not (tmp_path / "hf").exists() and not (tmp_path / "x").exists()


def test_unsupported_architectures_are_refused_by_their_args(ckpt_factory, tmp_path):
    convert(ckpt_factory("tiny"), tmp_path / "t", "hf", "megatron-torch")
    f = stage_file(tmp_path / "t", 0, 0, 1)
    ck = torch.load(f, weights_only=False)
    ck["args"].position_embedding_type = "yarn"  # (rope reads as starcoder2: tests/unit/test_starcoder2_converters.py)
    torch.save(ck, f)
    with pytest.raises(ConversionError, match="args.position_embedding_type = 'yarn'"):
        megatron_torch.read(tmp_path / "t")


def test_cli_writes_te_names_and_notes_that_legacy_is_gone(ckpt_factory, tmp_path, capsys):
    from converters.cli import main

    src = ckpt_factory("tiny")
    assert main(["--from", "hf", "--to", "megatron-torch", "--layer-spec", "te", "--quiet", str(src),
                 str(tmp_path / "t")]) == 0
    model = load(stage_file(tmp_path / "t", 0, 0, 1))["model"]
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in model
    assert "current Megatron-LM" not in capsys.readouterr().err
    assert main(["--from", "hf", "--to", "megatron-legacy", "--quiet", str(src), str(tmp_path / "l")]) == 0
    err = capsys.readouterr().err
    assert err.count("current Megatron-LM cannot load it (use --to megatron-torch or --to megatron)") == 1


def _edit(f, fn):
    ck = torch.load(f, weights_only=False)  # our own file, edited as a user would
    fn(ck["model"])
    torch.save(ck, f)


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("damage, message", [
    ("truncated", r"cannot read .*mp_rank_01"),
    ("missing", r"TP rank 1: missing 1 tensor.*decoder.layers.0.mlp.linear_fc1.weight"),
    ("extra", r"TP rank 0: 1 unexpected tensor.*rotary_pos_emb.inv_freq"),
    ("shape",
     r"TP rank 1: decoder.layers.1.self_attention.linear_proj.weight has shape \(64, 64\), expected \(64, 32\)"),
    ("differs", r"decoder.layers.1.pre_mlp_layernorm.weight: replicated tensor differs between TP ranks 0 and 1"),
    ("pickle", r"(refus|Unsupported global|not an allowed global).*(posix|os).system"),
])
def test_broken_files_are_one_clear_error(damage, message, ckpt_factory, tmp_path):
    convert(ckpt_factory("tiny"), tmp_path / "t", "hf", "megatron-torch", tp_size=2)
    f0, f1 = stage_file(tmp_path / "t", 0, 0, 1), stage_file(tmp_path / "t", 1, 0, 1)
    marker = tmp_path / "pwned"
    if damage == "truncated":
        f1.write_bytes(f1.read_bytes()[:1000])
    elif damage == "missing":
        _edit(f1, lambda m: m.pop("decoder.layers.0.mlp.linear_fc1.weight"))
    elif damage == "extra":
        _edit(f0, lambda m: m.update({"decoder.rotary_pos_emb.inv_freq": torch.ones(8)}))
    elif damage == "shape":
        _edit(f1, lambda m: m.update({"decoder.layers.1.self_attention.linear_proj.weight": torch.ones(64, 64)}))
    elif damage == "differs":
        _edit(f1, lambda m: m["decoder.layers.1.pre_mlp_layernorm.weight"].add_(1.0))
    elif damage == "pickle":
        _edit(f1, lambda m: m.update({"decoder.layers.0.self_attention.linear_qkv._extra_state": _Payload(marker)}))
    with pytest.raises(ConversionError, match=message) as e:
        convert(tmp_path / "t", tmp_path / "hf", "megatron-torch", "hf")
    assert "\n" not in str(e.value)
    assert not marker.exists() and not (tmp_path / "hf").exists()

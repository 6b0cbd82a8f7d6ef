"""Megatron-LM legacy checkpoints (converters/megatron_legacy.py): TP x PP stages both ways, the args
NVIDIA Megatron-LM's loader reads, MQA at TP > 1 in NVIDIA's layout, iterations, broken layouts (a planted
pickle: tests/integration/test_fresh_processes.py)."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from converters import convert, megatron_legacy
from converters.mapping import ConversionError
from plugins.core.config import kv_heads

# Every args field a loader of these files reads from the checkpoint (researched in NVIDIA
# Megatron-LM core_v0.16.1 and HF transformers' megatron_gpt2 converter):
NVIDIA_CHECK_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "add_position_embedding",
                     "max_position_embeddings", "make_vocab_size_divisible_by", "padded_vocab_size", "tokenizer_type",
                     "tensor_model_parallel_size",
                     "pipeline_model_parallel_size")  # checkpointing.check_checkpoint_args
NVIDIA_LOAD_ARGS = ("ffn_hidden_size", "seq_length", "kv_channels", "num_query_groups", "group_query_attention",
                    "position_embedding_type", "add_bias_linear", "add_qkv_bias", "swiglu",
                    "untie_embeddings_and_output_weights", "apply_layernorm_1p", "normalization",
                    "apply_query_key_layer_scaling", "attention_dropout", "hidden_dropout",
                    "consumed_train_samples", "consumed_valid_samples")  # load_args_from_checkpoint, load_checkpoint
NVIDIA_TOOLS_ARGS = ("fp16", "bf16", "params_dtype", "bert_binary_head")  # tools/checkpoint/loader_legacy.py
HF_MEGATRON_GPT2_ARGS = ("padded_vocab_size", "max_position_embeddings", "hidden_size", "num_layers",
                         "num_attention_heads", "ffn_hidden_size", "bias_gelu_fusion", "openai_gelu", "tokenizer_type")


def stage_file(d, tp, pp, pp_size, it="release"):
    return megatron_legacy.rank_dir(Path(d) / it, tp, pp, pp_size) / "model_optim_rng.pt"


def load_for_edit(f):
    """A stage file of ours, fully in memory (the converter maps files: saving over a mapped file would
    pull the pages out from under it)."""
    return torch.load(f, map_location="cpu", weights_only=False)


def read_hf(d):
    return load_file(Path(d) / "model.safetensors")


def same_weights(a, b):
    wa, wb = read_hf(a), read_hf(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("name", ["tiny", "tiny-mha"])
def test_tp2_pp2_round_trip_is_bit_exact(name, ckpt_factory, tmp_path):
    src = ckpt_factory(name)
    convert(src, tmp_path / "l", "hf", "megatron-legacy", tp_size=2, pp_size=2)
    dirs = sorted(p.name for p in (tmp_path / "l" / "release").iterdir())
    assert dirs == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    first = megatron_legacy.load_checkpoint_file(stage_file(tmp_path / "l", 1, 0, 2))["model"]
    last = megatron_legacy.load_checkpoint_file(stage_file(tmp_path / "l", 1, 1, 2))["model"]
    assert set(first["language_model"]) == {"embedding", "encoder"}  # embeddings on the first stage only
    assert set(first["language_model"]["encoder"]) == {f"layers.0.{k}" for k in (
        "input_layernorm.weight", "input_layernorm.bias", "self_attention.query_key_value.weight",
        "self_attention.query_key_value.bias", "self_attention.dense.weight", "self_attention.dense.bias",
        "post_attention_layernorm.weight", "post_attention_layernorm.bias", "mlp.dense_h_to_4h.weight",
        "mlp.dense_h_to_4h.bias", "mlp.dense_4h_to_h.weight", "mlp.dense_4h_to_h.bias")} | {
        f"layers.0.{k}._extra_state" for k in (  # megatron-core linears' extra state: a strict load needs it
            "self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")}
    assert first["language_model"]["encoder"]["layers.0.self_attention.dense._extra_state"] is None
    enc = last["language_model"]["encoder"]  # layer 1 of the model is layer 0 of stage 1 (local index)
    assert "layers.0.input_layernorm.weight" in enc and "final_layernorm.weight" in enc and \
        "layers.1.mlp.dense_h_to_4h.bias" not in enc
    assert "embedding" not in last["language_model"]
    emb = first["language_model"]["embedding"]["word_embeddings"]["weight"]
    assert torch.equal(last["word_embeddings_for_head"]["weight"], emb)  # tied: the head's copy, TP-sharded
    convert(tmp_path / "l", tmp_path / "back", "megatron-legacy", "hf")
    assert same_weights(src, tmp_path / "back")


def test_tp1_pp4_and_untied_head_on_the_last_stage(ckpt_factory, tmp_path):
    src = ckpt_factory("tiny", n_layer=4, tie_word_embeddings=False, vocab_size=50000)
    convert(src, tmp_path / "l", "hf", "megatron-legacy", pp_size=4)
    for p in range(4):
        model = megatron_legacy.load_checkpoint_file(stage_file(tmp_path / "l", 0, p, 4))["model"]
        assert ("output_layer" in model["language_model"]) == (p == 3)
        assert "word_embeddings_for_head" not in model  # untied: the head is output_layer
    convert(tmp_path / "l", tmp_path / "back", "megatron-legacy", "hf")
    assert same_weights(src, tmp_path / "back")


def test_written_args_carry_what_nvidia_megatron_and_hf_read(ckpt_factory, tmp_path):
    convert(ckpt_factory("tiny"), tmp_path / "l", "hf", "megatron-legacy", tp_size=2, pp_size=2, dtype="bfloat16")
    ck = megatron_legacy.load_checkpoint_file(stage_file(tmp_path / "l", 0, 0, 2))
    args = ck["args"]
    for name in NVIDIA_CHECK_ARGS + NVIDIA_LOAD_ARGS + NVIDIA_TOOLS_ARGS + HF_MEGATRON_GPT2_ARGS:
        assert hasattr(args, name), name
    assert ck["iteration"] == 0 and ck["checkpoint_version"] == 3.0
    assert args.bf16 and not args.fp16 and args.params_dtype == torch.bfloat16
    assert args.tokenizer_type == "GPT2BPETokenizer" and args.position_embedding_type == "learned_absolute"
    assert args.pipeline_model_parallel_size == 2 and args.tensor_model_parallel_size == 2


def test_mqa_at_tp2_is_written_with_a_kv_group_per_rank_and_reads_back_as_mqa(ckpt_factory, tmp_path):
    """NVIDIA's legacy attention needs num_query_groups % TP == 0: the one K/V head is stored once per
    group (the same model) and pooled back, bit-exactly, on read."""
    src = ckpt_factory("tiny")
    convert(src, tmp_path / "l", "hf", "megatron-legacy", tp_size=2)
    args = megatron_legacy.load_checkpoint_file(stage_file(tmp_path / "l", 0, 0, 1))["args"]
    assert args.group_query_attention and args.num_query_groups == 2 and args.num_query_groups % 2 == 0
    config, hub = megatron_legacy.read(tmp_path / "l")
    assert config.multi_query and kv_heads(config) == 1
    want = load_file(Path(src) / "model.safetensors")
    assert all(torch.equal(hub[k], want[k]) for k in want)


def test_iterations_and_the_tracker(ckpt_factory, tmp_path):
    src = ckpt_factory("tiny")
    convert(src, tmp_path / "l", "hf", "megatron-legacy")
    root = tmp_path / "l"
    for it in (1000, 2000):  # a training run's iterations: iter_XXXXXXX dirs holding their number
        d = root / f"iter_{it:07d}" / "mp_rank_00"
        d.mkdir(parents=True)
        ck = load_for_edit(root / "release" / "mp_rank_00" / "model_optim_rng.pt")
        ck["iteration"] = it
        ck["model"]["language_model"]["encoder"]["final_layernorm.bias"] = torch.full((64,), float(it))
        ck["optimizer"] = {"state": {}}  # ignored: weights only
        torch.save(ck, d / "model_optim_rng.pt")
        (d / "distrib_optim.pt").write_bytes(b"the distributed optimizer's shard: never read")
    (root / "latest_checkpointed_iteration.txt").write_text("2000")
    assert megatron_legacy.read(root)[1]["transformer.ln_f.bias"][0] == 2000  # the tracker's
    assert megatron_legacy.read(root, iteration=1000)[1]["transformer.ln_f.bias"][0] == 1000
    with pytest.raises(ConversionError, match="no iteration 3000 .*iter_0001000, iter_0002000"):
        megatron_legacy.read(root, iteration=3000)
    convert(root, tmp_path / "hf1000", "megatron-legacy", "hf", iteration=1000)
    assert read_hf(tmp_path / "hf1000")["transformer.ln_f.bias"][0] == 1000


def _pp2(ckpt_factory, tmp_path, **kw):
    convert(ckpt_factory("tiny", n_layer=4), tmp_path / "l", "hf", "megatron-legacy", tp_size=2, pp_size=2, **kw)
    return tmp_path / "l"


def test_missing_stage_is_one_clear_error(ckpt_factory, tmp_path):
    root = _pp2(ckpt_factory, tmp_path)
    import shutil

    shutil.rmtree(stage_file(root, 1, 1, 2).parent)
    with pytest.raises(ConversionError, match=r"TP=2 x PP=2; missing \['mp_rank_01_001'\]"):
        convert(root, tmp_path / "hf", "megatron-legacy", "hf")
    assert not (tmp_path / "hf").exists()


def test_stage_from_another_iteration_is_refused(ckpt_factory, tmp_path):
    root = _pp2(ckpt_factory, tmp_path)
    f = stage_file(root, 0, 1, 2)
    ck = load_for_edit(f)
    ck["iteration"] = 500
    torch.save(ck, f)
    with pytest.raises(ConversionError, match="holds iteration 500.*another iteration"):
        convert(root, tmp_path / "hf", "megatron-legacy", "hf")


def test_layer_counts_that_do_not_add_up_are_refused(ckpt_factory, tmp_path):
    root = _pp2(ckpt_factory, tmp_path)
    f = stage_file(root, 0, 1, 2)
    ck = load_for_edit(f)
    enc = ck["model"]["language_model"]["encoder"]
    for k in [k for k in enc if k.startswith("layers.1.")]:
        del enc[k]
    torch.save(ck, f)
    with pytest.raises(ConversionError, match=r"pipeline stage 1 holds layers \[0\] \(1\), the args say 2"):
        convert(root, tmp_path / "hf", "megatron-legacy", "hf")
    for p in (0, 1):  # args that do not split: 4 layers declared over 3 stages
        for t in (0, 1):
            f = stage_file(root, t, p, 2)
            ck = load_for_edit(f)
            ck["args"].pipeline_model_parallel_size = 3
            torch.save(ck, f)
    with pytest.raises(ConversionError, match="num_layers 4 is not divisible by pipeline_model_parallel_size 3"):
        convert(root, tmp_path / "hf", "megatron-legacy", "hf")


def test_uneven_stages_declared_by_args_are_read(ckpt_factory, tmp_path):
    """megatron-core's decoder_first_pipeline_num_layers: stage 0 holds 1 layer, stage 1 holds 3."""
    src = ckpt_factory("tiny", n_layer=4)
    root = _pp2(ckpt_factory, tmp_path)
    full = {}
    for t in (0, 1):
        stages = [megatron_legacy.flatten(load_for_edit(stage_file(root, t, p, 2))["model"]) for p in (0, 1)]
        full[t] = megatron_legacy.merge_stages(stages, [2, 2], True, "test")
    for t in (0, 1):
        for p, stage in enumerate(megatron_legacy.split_stages(full[t], [1, 3], True)):
            f = stage_file(root, t, p, 2)
            ck = load_for_edit(f)
            ck["model"] = megatron_legacy.nest(stage)
            ck["args"].decoder_first_pipeline_num_layers = 1
            torch.save(ck, f)
    convert(root, tmp_path / "hf", "megatron-legacy", "hf")
    assert same_weights(src, tmp_path / "hf")


def test_virtual_pipeline_stages_are_refused(ckpt_factory, tmp_path):
    root = _pp2(ckpt_factory, tmp_path)
    f = stage_file(root, 0, 0, 2)
    ck = load_for_edit(f)
    ck["model0"], ck["model1"] = ck.pop("model"), {}
    torch.save(ck, f)
    with pytest.raises(ConversionError, match="virtual pipeline stages"):
        convert(root, tmp_path / "hf", "megatron-legacy", "hf")


def test_newer_nvidia_norm_names_are_read(ckpt_factory, tmp_path):
    """NVIDIA Megatron-LM saves `input_norm` / `post_attention_norm` / `final_norm` since late 2023."""
    src = ckpt_factory("tiny")
    convert(src, tmp_path / "l", "hf", "megatron-legacy")
    f = stage_file(tmp_path / "l", 0, 0, 1)
    ck = load_for_edit(f)
    enc = ck["model"]["language_model"]["encoder"]
    ck["model"]["language_model"]["encoder"] = {k.replace("layernorm", "norm"): v for k, v in enc.items()}
    torch.save(ck, f)
    convert(tmp_path / "l", tmp_path / "hf", "megatron-legacy", "hf")
    assert same_weights(src, tmp_path / "hf")


def _global_name(g) -> str:
    return g[1] if isinstance(g, tuple) else f"{g.__module__}.{g.__qualname__}"


def test_plain_safe_globals_are_megatron_cores_own():
    """The reader allows the stdlib, numpy and torch types megatron-core allows (without importing megatron.core
    for a file that names none of its classes); fails if megatron.core.safe_globals changes its list. 0.19 adds
    torch._C.Generator (its safe_globals.py: "Needed for torch ckpt format loading"), which 0.16.1 lacks."""
    from megatron.core.safe_globals import SAFE_GLOBALS

    from converters.megatron_pt import PLAIN_GLOBALS

    upstream = {_global_name(g) for g in SAFE_GLOBALS if not g.__module__.startswith("megatron.")}
    assert {_global_name(g) for g in PLAIN_GLOBALS} == upstream | {"torch._C.Generator"}


def test_reading_leaves_the_process_wide_safe_globals_alone(ckpt_factory, tmp_path):
    """megatron-core registers its safe globals for the whole process (Megatron-LM's torch.load relies on them);
    reading a checkpoint must not unregister them on the way out."""
    from megatron.core.safe_globals import register_safe_globals

    convert(ckpt_factory("tiny"), tmp_path / "l", "hf", "megatron-legacy")
    register_safe_globals()
    before = set(torch.serialization.get_safe_globals())
    megatron_legacy.load_checkpoint_file(stage_file(tmp_path / "l", 0, 0, 1))
    assert set(torch.serialization.get_safe_globals()) == before


class _CudaGenerator:
    """Pickles as Megatron-LM's graph-safe RNG tracker state of a GPU run does: torch.Generator's own
    __reduce__ (class, (device,), (seed, offset, state)), on device cuda:0."""

    def __init__(self, seed):
        self.gen = torch.Generator()
        self.gen.manual_seed(seed)

    def __reduce__(self):
        return torch._C.Generator, (torch.device("cuda", 0),), self.gen.__reduce__()[2]


def test_training_rng_state_with_generators_loads_inert(ckpt_factory, tmp_path):
    """A training checkpoint's rng_state (numpy state, CPU and CUDA generators) reads on a CPU-only torch, as inert
    values: the real class would build a CUDA generator (refused here), and no code from the file runs."""
    import numpy as np

    from converters.megatron_pt import GeneratorState

    convert(ckpt_factory("tiny"), tmp_path / "l", "hf", "megatron-legacy")
    f = stage_file(tmp_path / "l", 0, 0, 1)
    ck = load_for_edit(f)
    cpu = torch.Generator()
    cpu.manual_seed(3)
    ck["rng_state"] = [{"random_rng_state": (3, tuple(range(5)), None), "np_rng_state": np.random.get_state(),
                        "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.zeros(16, dtype=torch.uint8),
                        "rng_tracker_states": {"model-parallel-rng": _CudaGenerator(11), "cpu": cpu}}]
    torch.save(ck, f)
    assert "torch._C.Generator" in torch.serialization.get_unsafe_globals_in_checkpoint(f)
    with pytest.raises(Exception):  # what the real class does with it on this machine
        with torch.serialization.safe_globals([torch._C.Generator]):
            torch.load(f, weights_only=True)
    states = megatron_legacy.load_checkpoint_file(f)["rng_state"][0]["rng_tracker_states"]
    assert {k: (type(v), v.device.type, v.state[0]) for k, v in states.items()} == {
        "model-parallel-rng": (GeneratorState, "cuda", 11), "cpu": (GeneratorState, "cpu", 3)}
    convert(tmp_path / "l", tmp_path / "hf", "megatron-legacy", "hf")  # weights only: rng_state ignored
    assert same_weights(ckpt_factory("tiny"), tmp_path / "hf")

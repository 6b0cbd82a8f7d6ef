"""BigCode's Megatron-LM fork (converters/bigcode_megatron.py): checkpoints written here the way the fork
writes them (its layout, its TP x PP stages, its args with the fork's own enum pickled in), read into HF
exactly; and our writer's fork layout read back."""

import enum
import sys
import types
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from converters import convert
from converters.mapping import ConversionError
from plugins.core.checkpoint import load_hf_model
from plugins.hf import HFBackend


class PositionEmbeddingType(enum.Enum):  # the fork's megatron/model/enums.py
    rotary = 1
    absolute = 2
    alibi = 3


def fork_enum_module():
    """The fork's `megatron.model.enums` as a module, so torch.save pickles the global the fork pickles."""
    module = types.ModuleType("megatron.model.enums")
    module.PositionEmbeddingType = PositionEmbeddingType
    PositionEmbeddingType.__module__ = "megatron.model.enums"
    return {"megatron.model": types.ModuleType("megatron.model"), "megatron.model.enums": module}


def write_bigcode_fork(model, dst, tp, pp=1, iteration=1000):
    """A BigCode-fork checkpoint written straight from the fork's layout (its checkpointing.py, transformer.py,
    language_model.py: local layer indices per stage, embeddings on the first stage, final_layernorm and the
    tied head's `word_embeddings_for_head` on the last), not via our converters."""
    c, sd = model.config, model.state_dict()
    h, n = c.n_embd, c.n_head
    from megatron.core.enums import ModelType

    args = Namespace(num_layers=c.n_layer, hidden_size=h, ffn_hidden_size=4 * h, num_attention_heads=n,
                     kv_channels=h // n, max_position_embeddings=c.n_positions, padded_vocab_size=c.vocab_size,
                     attention_head_type="multiquery" if c.multi_query else "multihead", bias_gelu_fusion=True,
                     openai_gelu=False, layernorm_epsilon=c.layer_norm_epsilon, tensor_model_parallel_size=tp,
                     pipeline_model_parallel_size=pp, position_embedding_type=PositionEmbeddingType.absolute,
                     model_type=ModelType.encoder_or_decoder, params_dtype=torch.float32, fp16=False, bf16=False,
                     tokenizer_type="TokenizerFromFile", make_vocab_size_divisible_by=128)
    dst.mkdir(parents=True)
    (dst / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")
    per_stage = c.n_layer // pp
    saved = {k: sys.modules.get(k) for k in ("megatron.model", "megatron.model.enums")}
    sys.modules.update(fork_enum_module())
    try:
        for r in range(tp):
            def part(t, dim):
                return t.chunk(tp, dim)[r].clone()

            for s in range(pp):
                enc = {}
                for local in range(per_stage):
                    i = s * per_stage + local
                    p, q = f"transformer.h.{i}.", f"layers.{local}."
                    for kind in ("weight", "bias"):
                        c_attn = sd[p + "attn.c_attn." + kind]
                        if c.multi_query:
                            enc[q + "self_attention.query." + kind] = part(c_attn[:h], 0)
                            enc[q + "self_attention.key_value." + kind] = c_attn[h:].clone()
                        else:
                            enc[q + "self_attention.query_key_value." + kind] = part(c_attn, 0)
                        enc[q + "input_layernorm." + kind] = sd[p + "ln_1." + kind]
                        enc[q + "post_attention_layernorm." + kind] = sd[p + "ln_2." + kind]
                        enc[q + "mlp.dense_h_to_4h." + kind] = part(sd[p + "mlp.c_fc." + kind], 0)
                    enc[q + "self_attention.dense.weight"] = part(sd[p + "attn.c_proj.weight"], 1)
                    enc[q + "self_attention.dense.bias"] = sd[p + "attn.c_proj.bias"]
                    enc[q + "mlp.dense_4h_to_h.weight"] = part(sd[p + "mlp.c_proj.weight"], 1)
                    enc[q + "mlp.dense_4h_to_h.bias"] = sd[p + "mlp.c_proj.bias"]
                model_sd = {"language_model": {"transformer": enc}}  # the fork's (older) name for the encoder
                if s == 0:
                    model_sd["language_model"]["embedding"] = {
                        "word_embeddings": {"weight": part(sd["transformer.wte.weight"], 0)},
                        "position_embeddings": {"weight": sd["transformer.wpe.weight"]}}
                if s == pp - 1:
                    enc["final_layernorm.weight"] = sd["transformer.ln_f.weight"]
                    enc["final_layernorm.bias"] = sd["transformer.ln_f.bias"]
                    if pp > 1:
                        model_sd["word_embeddings_for_head"] = {"weight": part(sd["transformer.wte.weight"], 0)}
                name = f"mp_rank_{r:02d}" if pp == 1 else f"mp_rank_{r:02d}_{s:03d}"
                d = dst / f"iter_{iteration:07d}" / name
                d.mkdir(parents=True)
                torch.save({"args": args, "checkpoint_version": 3.0, "iteration": iteration, "model": model_sd,
                            "optimizer": {"fp32_from_fp16_params": []}, "rng_state": [{}]}, d / "model_optim_rng.pt")
    finally:
        for k, v in saved.items():
            sys.modules.pop(k) if v is None else sys.modules.__setitem__(k, v)


def read_hf(d):
    return load_file(Path(d) / "model.safetensors")


def test_fork_args_pickle_the_forks_enum(ckpt_factory, tmp_path):
    """The fixture writes what the fork writes: torch's weights-only loader refuses it without our stand-ins."""
    write_bigcode_fork(load_hf_model(ckpt_factory("tiny")), tmp_path / "fork", tp=1)
    f = tmp_path / "fork" / "iter_0001000" / "mp_rank_00" / "model_optim_rng.pt"
    assert "megatron.model.enums.PositionEmbeddingType" in torch.serialization.get_unsafe_globals_in_checkpoint(f)
    from converters.megatron_legacy import load_checkpoint_file

    args = load_checkpoint_file(f)["args"]
    assert args.position_embedding_type.name == "absolute" and args.position_embedding_type.value == 2


@pytest.mark.parametrize("name", ["tiny", "tiny-mha"])
def test_fork_tp2_pp2_imports_to_hf_exactly(name, ckpt_factory, tmp_path, padded_batch):
    src = ckpt_factory(name, n_layer=4)
    write_bigcode_fork(load_hf_model(src), tmp_path / "fork", tp=2, pp=2)
    convert(tmp_path / "fork", tmp_path / "hf", "bigcode-megatron", "hf")
    w0, w1 = read_hf(src), read_hf(tmp_path / "hf")
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
    _, ids, mask = padded_batch
    a, b = HFBackend.from_hf(src), HFBackend.from_hf(tmp_path / "hf")
    assert (a.logits(ids, mask) - b.logits(ids, mask))[mask.bool()].abs().max() <= 1e-5
    assert torch.equal(a.generate(ids, mask, 16).tokens, b.generate(ids, mask, 16).tokens)


def edit_fork_file(f, edit) -> None:
    """Change a fork checkpoint file as a user of the fork would (it pickles the fork's enum)."""
    sys.modules.update(fork_enum_module())
    try:
        ck = torch.load(f, weights_only=False)
        edit(ck)
        torch.save(ck, f)
    finally:
        sys.modules.pop("megatron.model.enums"), sys.modules.pop("megatron.model")


def test_fork_differing_key_value_replicas_are_refused(ckpt_factory, tmp_path):
    write_bigcode_fork(load_hf_model(ckpt_factory("tiny")), tmp_path / "fork", tp=2)
    edit_fork_file(tmp_path / "fork" / "iter_0001000" / "mp_rank_01" / "model_optim_rng.pt", lambda ck: ck["model"][
        "language_model"]["transformer"]["layers.1.self_attention.key_value.weight"][0, 0].add_(1))
    with pytest.raises(ConversionError, match=r"layers.1.self_attention.key_value.weight: .*ranks 0 and 1"):
        convert(tmp_path / "fork", tmp_path / "hf", "bigcode-megatron", "hf")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("name", ["tiny", "tiny-mha"])
def test_our_fork_layout_round_trips_and_pickles_the_forks_enum(name, ckpt_factory, tmp_path):
    src = ckpt_factory(name, n_layer=4)
    convert(src, tmp_path / "fork", "hf", "bigcode-megatron", tp_size=2, pp_size=2)
    f = tmp_path / "fork" / "release" / "mp_rank_01_001" / "model_optim_rng.pt"
    assert "megatron.model.enums.PositionEmbeddingType" in torch.serialization.get_unsafe_globals_in_checkpoint(f)
    from converters.megatron_legacy import load_checkpoint_file

    ck = load_checkpoint_file(f)
    enc = ck["model"]["language_model"]["encoder"]
    if name == "tiny":  # the fork's MQA: query split over TP, key_value whole on every rank
        assert enc["layers.0.self_attention.query.weight"].shape == (32, 64)
        assert enc["layers.0.self_attention.key_value.weight"].shape == (32, 64)
    assert ck["args"].attention_head_type == ("multiquery" if name == "tiny" else "multihead")
    convert(tmp_path / "fork", tmp_path / "hf", "bigcode-megatron", "hf")
    w0, w1 = read_hf(src), read_hf(tmp_path / "hf")
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


def test_rotary_fork_checkpoints_are_refused(ckpt_factory, tmp_path):
    write_bigcode_fork(load_hf_model(ckpt_factory("tiny")), tmp_path / "fork", tp=1)
    edit_fork_file(tmp_path / "fork" / "iter_0001000" / "mp_rank_00" / "model_optim_rng.pt",
                   lambda ck: setattr(ck["args"], "position_embedding_type", PositionEmbeddingType.rotary))
    with pytest.raises(ConversionError, match="position_embedding_type 'rotary'"):
        convert(tmp_path / "fork", tmp_path / "hf", "bigcode-megatron", "hf")

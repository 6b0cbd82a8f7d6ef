"""StarCoder2 through the one mapping table (converters.mapping: its starcoder2 column): q / k / v fused into
Megatron's per-group `linear_qkv` [q heads of the group | k | v], RoPE and the window in the args, and HF <->
megatron / megatron-torch / megatron-legacy round trips bit-exact at any TP x PP."""

from pathlib import Path

import pytest
import torch
from conversion_helpers import hub_of, load_rank
from transformers import Starcoder2ForCausalLM

from converters import convert, megatron_legacy, megatron_torch
from converters.mapping import ConversionError, hf_to_mcore, mcore_to_hf
from plugins.core.arch import hf_shapes
from plugins.core.checkpoint import init_model, read_hf_config, read_hf_state
from plugins.core.config import load_model_config
from plugins.core.tensors import position_ids

H, D, N, G = 64, 16, 4, 2  # tiny-starcoder2: hidden, head dim, query heads, KV heads


@pytest.fixture(scope="module")
def sc2(ckpt_factory):
    return ckpt_factory("tiny-starcoder2")


def same_checkpoint(a, b) -> None:
    wa, wb = read_hf_state(a), read_hf_state(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert read_hf_config(a).to_dict() == {**read_hf_config(b).to_dict(), "architectures": ["Starcoder2ForCausalLM"]}


@pytest.mark.parametrize("tied", [True, False])
def test_table_covers_every_starcoder2_tensor(tied):
    config = load_model_config("tiny-starcoder2", tie_word_embeddings=tied)
    model = init_model(config)
    assert hf_shapes(config) == {k: tuple(v.shape) for k, v in hub_of(model).items()}
    hub = hub_of(model)
    ranks = hf_to_mcore(hub, config, tp_size=2)
    assert "embedding.position_embeddings.weight" not in ranks[0]  # RoPE: no table
    assert ("output_layer.weight" in ranks[0]) == (not tied)
    # one KV group per rank: its 2 query heads, then its K head, then its V head
    for r, st in enumerate(ranks):
        qkv = st["decoder.layers.1.self_attention.linear_qkv.weight"]
        p = "model.layers.1.self_attn."
        want = torch.cat([hub[p + "q_proj.weight"][r * 2 * D:(r + 1) * 2 * D],
                          hub[p + "k_proj.weight"][r * D:(r + 1) * D], hub[p + "v_proj.weight"][r * D:(r + 1) * D]])
        assert torch.equal(qkv, want)
        assert st["decoder.layers.1.self_attention.linear_qkv.bias"].shape == (4 * D,)
    back = mcore_to_hf(ranks, config)
    assert back.keys() == hub.keys() and all(torch.equal(back[k], hub[k]) for k in hub)


@pytest.mark.parametrize("fmt,kwargs", [("megatron", {"tp_size": 2}),
                                        ("megatron-torch", {"tp_size": 2, "pp_size": 2}),
                                        ("megatron-torch", {"tp_size": 2, "pp_size": 2, "layer_spec": "te"}),
                                        ("megatron-legacy", {"tp_size": 2, "pp_size": 2}),
                                        ("megatron-legacy", {"tp_size": 4})],
                         ids=["megatron-tp2", "torch-tp2pp2", "torch-te-tp2pp2", "legacy-tp2pp2", "legacy-tp4"])
def test_round_trip_is_bit_exact(sc2, tmp_path, fmt, kwargs):
    summary = convert(sc2, tmp_path / "m", "hf", fmt, **kwargs)
    assert summary["kv_heads"] == G
    convert(tmp_path / "m", tmp_path / "back", fmt, "hf")
    same_checkpoint(sc2, tmp_path / "back")


def test_megatron_args_carry_rope_and_the_window(sc2, tmp_path):
    with pytest.warns(UserWarning, match="legacy GPT model .* without --rotary-base"):
        convert(sc2, tmp_path / "l", "hf", "megatron-legacy", tp_size=2, pp_size=2)
    convert(sc2, tmp_path / "t", "hf", "megatron-torch", tp_size=2)
    for ck in (load_rank(tmp_path / "t", 1),):  # a TP rank's file of megatron-torch
        args = ck["args"]
        assert (args.position_embedding_type, args.add_position_embedding, args.use_rotary_position_embeddings) == \
            ("rope", False, True)
        assert (args.rotary_base, args.rotary_percent, args.rotary_interleaved) == (10000.0, 1.0, False)
        assert args.window_size == (15, 0)  # HF's sliding_window 16: itself and 15 tokens before
        assert (args.num_query_groups, args.group_query_attention, args.seq_length) == (G, True, 256)
        assert "embedding.position_embeddings.weight" not in ck["model"]
    args, _ = megatron_legacy.read_layout(tmp_path / "l")[1:]
    assert args.window_size == (15, 0) and args.pipeline_model_parallel_size == 2
    # the 3B shape's rope_theta is not an integer: the args keep it exactly
    theta = load_model_config("starcoder2-3b").rope_parameters["rope_theta"]
    three = megatron_legacy.make_args(load_model_config("starcoder2-3b"), 1, 1, 49152, 2, torch.bfloat16)
    assert three.rotary_base == theta == 999999.4420358813 and three.window_size == (4095, 0)


def test_kv_heads_duplicated_for_tp4_in_legacy_come_back_as_two(sc2, tmp_path):
    """NVIDIA's legacy attention needs num_query_groups % TP == 0: at TP 4 each of the 2 KV heads is stored
    twice (the same model); reading pools the identical copies back."""
    convert(sc2, tmp_path / "l", "hf", "megatron-legacy", tp_size=4)
    args = load_rank(tmp_path / "l", 3)["args"]
    assert args.num_query_groups == 4
    config, hub = megatron_legacy.read(tmp_path / "l")
    assert config.num_key_value_heads == G and hub.keys() == read_hf_state(sc2).keys()


def test_kv_pooling_to_mqa_loads_in_transformers(sc2, tmp_path, padded_batch):
    convert(sc2, tmp_path / "mqa", "hf", "hf", kv_heads=1)
    config = read_hf_config(tmp_path / "mqa")
    assert config.num_key_value_heads == 1
    state = read_hf_state(tmp_path / "mqa")
    source = read_hf_state(sc2)
    k = source["model.layers.0.self_attn.k_proj.weight"].reshape(G, D, H).mean(0)
    assert torch.allclose(state["model.layers.0.self_attn.k_proj.weight"], k)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(state[q], source[q])
    model = Starcoder2ForCausalLM.from_pretrained(tmp_path / "mqa", dtype=torch.float32).eval()
    _, ids, mask = padded_batch
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits).all()


def test_formats_that_cannot_hold_starcoder2_refuse_it(sc2, tmp_path):
    with pytest.raises(ConversionError, match="BigCode Megatron-LM fork stores gpt_bigcode models"):
        convert(sc2, tmp_path / "f", "hf", "bigcode-megatron")
    with pytest.raises(ConversionError, match="tp_size 3 does not divide n_head 4"):
        convert(sc2, tmp_path / "t", "hf", "megatron-torch", tp_size=3)
    assert not Path(tmp_path / "f").exists() and not Path(tmp_path / "t").exists()


def test_rope_args_with_partial_rotary_are_refused(sc2, tmp_path):
    convert(sc2, tmp_path / "t", "hf", "megatron-torch")
    f = tmp_path / "t" / "release" / "mp_rank_00" / "model_optim_rng.pt"
    ck = torch.load(f, weights_only=False)  # our own file, edited as a user would
    ck["args"].rotary_percent = 0.5
    torch.save(ck, f)
    with pytest.raises(ConversionError, match="partial or interleaved rotary"):
        megatron_torch.read(tmp_path / "t")

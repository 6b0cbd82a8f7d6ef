"""Every writer's output is checked against what its consumer loads strictly before it is published
(converters/consumers.py): a key renamed in a writer's name table, which the same table's reader would read
back without complaint, fails the conversion with one line naming the key and leaves nothing behind."""

import pytest
from conversion_helpers import assert_nothing_left

from converters import convert, hf, mapping
from converters.mapping import ConversionError


def rename_in_table(monkeypatch, column: int, old: str, new: str) -> None:
    """The mapping table with one Megatron name changed (column 1: megatron-core, 2: legacy / BigCode)."""
    table = [tuple(row[:column]) + (row[column].replace(old, new),) + tuple(row[column + 1:]) for row in mapping.TABLE]
    assert table != mapping.TABLE
    monkeypatch.setattr(mapping, "TABLE", table)


def refused(src, dst, fmt, key, **kwargs) -> str:
    with pytest.raises(ConversionError) as e:
        convert(src, dst, "hf", fmt, **kwargs)
    msg = str(e.value)
    assert "\n" not in msg and "would refuse it in a strict load" in msg and repr(key) in msg, msg
    assert_nothing_left(dst)
    return msg


@pytest.mark.parametrize("kwargs", [{}, {"tp_size": 2, "pp_size": 2}])
def test_megatron_torch_local(kwargs, monkeypatch, ckpt_factory, tmp_path):
    src = ckpt_factory("tiny")
    rename_in_table(monkeypatch, 1, "self_attention.linear_proj.", "self_attention.linear_out.")
    refused(src, tmp_path / "t", "megatron-torch", "decoder.layers.0.self_attention.linear_out.bias", **kwargs)


def test_megatron_torch_te(monkeypatch, ckpt_factory, tmp_path):
    src = ckpt_factory("tiny")
    monkeypatch.setitem(mapping.TE_LAYER_NORMS, "input_layernorm.", "self_attention.linear_qkv.layernorm_")
    refused(src, tmp_path / "t", "megatron-torch", "decoder.layers.0.self_attention.linear_qkv.layernorm_bias",
            layer_spec="te")


def test_megatron_dist(monkeypatch, ckpt_factory, tmp_path):
    src = ckpt_factory("tiny")
    rename_in_table(monkeypatch, 1, "mlp.linear_fc2.", "mlp.linear_down.")
    refused(src, tmp_path / "m", "megatron", "decoder.layers.mlp.linear_down.bias", tp_size=2)


def test_megatron_legacy(monkeypatch, ckpt_factory, tmp_path):
    src = ckpt_factory("tiny")
    rename_in_table(monkeypatch, 2, "mlp.dense_h_to_4h.", "mlp.dense_up.")
    refused(src, tmp_path / "l", "megatron-legacy", "language_model/encoder/layers.0.mlp.dense_up.bias", pp_size=2)


@pytest.mark.parametrize("name", ["tiny", "tiny-mha"])
def test_bigcode_fork(name, monkeypatch, ckpt_factory, tmp_path):
    src = ckpt_factory(name)
    if name == "tiny":  # the fork's multi-query table
        mqa = {hf_name: [(n.replace(".key_value.", ".kv."), rule) for n, rule in targets]
               for hf_name, targets in mapping.BIGCODE_MQA.items()}
        monkeypatch.setattr(mapping, "BIGCODE_MQA", mqa)
        key = "language_model/encoder/layers.0.self_attention.kv.bias"
    else:
        rename_in_table(monkeypatch, 2, "post_attention_layernorm.", "pre_mlp_layernorm.")
        key = "language_model/encoder/layers.0.pre_mlp_layernorm.bias"
    refused(src, tmp_path / "f", "bigcode-megatron", key, tp_size=2)


def test_hf(monkeypatch, ckpt_factory, tmp_path):
    src = ckpt_factory("tiny-mha")
    save = hf.save_file

    def renaming(state, path, metadata=None):
        state = {k.replace("ln_f.", "norm_f."): v for k, v in state.items()}
        return save(state, path, metadata=metadata)

    monkeypatch.setattr(hf, "save_file", renaming)
    refused(src, tmp_path / "h", "hf", "transformer.norm_f.bias")


def test_unplanted_outputs_pass_and_the_check_runs(monkeypatch, ckpt_factory, tmp_path):
    """Without a plant every writer passes, and the check is what refused above: the consumers' key sets."""
    from converters import consumers

    calls = []
    real = consumers.check_strict
    monkeypatch.setattr(consumers, "check_strict", lambda *a: calls.append(a[3]) or real(*a))
    src = ckpt_factory("tiny")
    for fmt in ("hf", "megatron", "megatron-torch", "megatron-legacy", "bigcode-megatron"):
        convert(src, tmp_path / fmt, "hf", fmt)
    assert len(calls) == 5 and any("GPTModel" in c for c in calls) and any("legacy" in c for c in calls)

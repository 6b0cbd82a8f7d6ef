"""Model configs (plugins.core.config): the named architectures, strictness, clear errors."""


import pytest
from transformers import GPTBigCodeConfig

from plugins.core.config import ConfigError, load_model_config, load_spec, model_names


def test_model_configs_match_the_named_architectures():
    assert {"santacoder-1b", "santacoder-1b-mha", "starcoder-15b", "small", "tiny", "tiny-mha"} <= set(model_names())
    sc = load_model_config("santacoder-1b")
    assert isinstance(sc, GPTBigCodeConfig)
    assert (sc.n_layer, sc.n_embd, sc.n_head, sc.vocab_size, sc.n_positions) == (24, 2048, 16, 49280, 2048)
    assert sc.multi_query and sc.activation_function == "gelu_pytorch_tanh" and sc.layer_norm_epsilon == 1e-5
    assert not load_model_config("santacoder-1b-mha").multi_query
    st = load_model_config("starcoder-15b")
    assert (st.n_layer, st.n_embd, st.n_head, st.vocab_size, st.n_positions, st.multi_query) == \
        (40, 6144, 48, 49152, 8192, True)
    assert not load_model_config("tiny-mha").multi_query and load_model_config("tiny").multi_query


def test_unknown_config_key_is_an_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("n_layer: 2\nn_embd: 64\nn_head: 4\nvocab_size: 100\nn_positions: 64\nn_layers: 3\n")
    with pytest.raises(ConfigError, match="unknown key.*n_layers"):
        load_spec(bad)


def test_invalid_yaml_is_one_config_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("n_layer: [2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_spec(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_spec(bad)


def test_unknown_model_name_is_an_error():
    with pytest.raises(ConfigError, match="unknown model config 'nope'"):
        load_model_config("nope")


def test_config_rejects_heads_not_dividing_width():
    with pytest.raises(ConfigError, match="not divisible by n_head"):
        load_model_config("tiny", n_head=5)

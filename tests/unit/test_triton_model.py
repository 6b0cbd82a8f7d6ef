"""mqa-triton's pieces that need no Triton: a request's options from Triton's three ways of naming
them, the model configuration it writes, and its flags (mqa-serve's, every one)."""

import json

import pytest

from plugins.triton.params import DEFAULT_MAX_TOKENS, SEED_MODULUS, Invalid, parse
from plugins.triton.server import INPUTS, OUTPUTS, config_pbtxt


def test_defaults_are_vllms_sampling_params():
    asked = parse({"text_input": ["def f():"]})
    assert asked.text == "def f():" and asked.max_tokens == DEFAULT_MAX_TOKENS
    assert asked.sample and asked.temperature == 1.0 and not asked.stream
    assert asked.exclude_input_in_output and asked.stop == [] and asked.seed is None


def test_tensors_then_sampling_parameters_then_request_parameters():
    asked = parse({"text_input": ["x"], "max_tokens": [7], "temperature": [0.0],
                   "sampling_parameters": [json.dumps({"max_tokens": 9, "top_p": 0.5, "top_k": -1, "stop": "\n"})]},
                  {"max_tokens": 11, "top_p": 0.25, "seed": 3, "min_p": 0.1, "stream": True})
    assert asked.max_tokens == 7 and not asked.sample          # the tensor
    assert asked.top_p == 0.5 and asked.top_k == 0             # sampling_parameters (vLLM's -1: no top-k)
    assert asked.stop == ["\n"]
    assert asked.seed == 3 and asked.min_p == 0.1 and asked.stream  # request parameters


def test_tensorrt_llm_names():
    asked = parse({"text_input": ["x"], "random_seed": [2 ** 64 - 1], "stop_words": ["a", ""], "min_length": [2],
                   "max_tokens": [4], "beam_width": [1]}, {"bad_words": ""})
    assert asked.seed == (2 ** 64 - 1) % SEED_MODULUS and asked.stop == ["a"] and asked.min_tokens == 2


def test_unknown_names_are_ignored_and_named():
    asked = parse({"text_input": ["x"]}, {"foo": 1, "triton_x": 2})
    assert asked.ignored == ["parameters.foo", "parameters.triton_x"]


@pytest.mark.parametrize("inputs, parameters, message", [
    ({}, None, "`text_input` is required"),
    ({"text_input": [""]}, None, "`text_input` is empty"),
    ({"text_input": ["a", "b"]}, None, "`text_input` must hold one value"),
    ({"text_input": ["\udcff"]}, None, "`text_input` is not valid UTF-8"),
    ({"text_input": ["x"], "max_tokens": [0]}, None, "`max_tokens` must be >= 1"),
    ({"text_input": ["x"], "temperature": [float("nan")]}, None, "`temperature` must be a finite number"),
    ({"text_input": ["x"], "top_p": [0.0]}, None, "`top_p` must be in (0.0, 1.0]"),
    ({"text_input": ["x"]}, {"max_tokens": "7"}, "`max_tokens` must be an integer"),
    ({"text_input": ["x"]}, {"stream": 1}, "`stream` must be a boolean"),
    ({"text_input": ["x"], "min_tokens": [9], "max_tokens": [4]}, None, "`min_tokens` (9) must be <= `max_tokens` (4)"),
    ({"text_input": ["x"], "sampling_parameters": ["{"]}, None, "`sampling_parameters` is not JSON"),
    ({"text_input": ["x"], "sampling_parameters": ["[1]"]}, None, "`sampling_parameters` must be a JSON object"),
    ({"text_input": ["x"], "sampling_parameters": ['{"n": 2}']}, None, "`sampling_parameters.n` 2 is not supported"),
    ({"text_input": ["x"]}, {"use_beam_search": True}, "`parameters.use_beam_search` True is not supported"),
    ({"text_input": ["x"], "beam_width": [4]}, None, "`beam_width` 4 is not supported"),
    ({"text_input": ["x"], "stop": ["s"] * 65}, None, "`stop` holds 65 strings, at most 64"),
])
def test_refused_by_name(inputs, parameters, message):
    with pytest.raises(Invalid) as e:
        parse(inputs, parameters)
    assert message in str(e.value)


def test_every_declared_input_means_something():
    from plugins.triton.params import ALIASES, OPTIONS
    for name, _, _ in INPUTS:
        assert name in ("text_input", "sampling_parameters") or ALIASES.get(name, name) in OPTIONS, name


def test_model_config():
    text = config_pbtxt("santacoder", 3, "/tmp/x/engine.sock")
    assert 'backend: "python"' in text and "decoupled: true" in text and "count: 3 kind: KIND_CPU" in text
    assert '{ name: "text_input" data_type: TYPE_STRING dims: [ 1 ] }' in text  # the one required input
    assert text.count("optional: true") == len(INPUTS) - 1
    assert all(f'name: "{name}"' in text for name, _, _ in OUTPUTS)
    assert 'string_value: "/tmp/x/engine.sock"' in text


def test_every_mqa_serve_flag_is_taken(tmp_path):
    from plugins.http import cli as serve_cli
    from plugins.triton.cli import parse_args

    serve_ap, _ = serve_cli.parse_args(["ckpt"])
    _, args = parse_args(["ckpt", "--grpc-port", "9001"])
    for action in serve_ap._actions:
        if action.dest != "help":
            assert hasattr(args, action.dest), action.dest
    assert args.port == 8000 and args.grpc_port == 9001 and args.metrics_port == 8002 and args.instances == 1
    _, args = parse_args(["ckpt", "--max-waiting", "3", "--kv-budget", "2MB", "--speculative", "prompt-lookup"])
    assert args.max_waiting == 3 and args.kv_budget == 2 << 20 and args.speculative == "prompt-lookup"

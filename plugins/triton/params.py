"""What a Triton request asks, from the names Triton's LLM backends give it, checked.

A request names its sampling options three ways, each as one of Triton's LLM examples does: as input
tensors (TensorRT-LLM's ensemble: `max_tokens`, `temperature`, `top_k`, `stop_words`, `random_seed`...;
the generate endpoint turns a top-level JSON field of the same name into that tensor), as one JSON
string `sampling_parameters` (the vLLM backend's, vLLM's SamplingParams names), or as request
parameters (`"parameters": {...}` of the generate and KServe v2 bodies). The first of the three that
names an option wins. Defaults are vLLM's SamplingParams': 16 tokens, temperature 1 (0 is greedy).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

MAX_STOP = 64       # stop strings, as the OpenAI routes allow
DEFAULT_MAX_TOKENS = 16
SEED_MODULUS = 1 << 63  # any integer seed is taken, reduced into the sampler's range (as the OpenAI routes do)

# Triton input -> our option; the aliases are TensorRT-LLM's names for the same thing
ALIASES = {"random_seed": "seed", "stop_words": "stop", "min_length": "min_tokens"}
FLAGS = ("stream", "exclude_input_in_output", "return_finish_reason", "return_num_input_tokens",
         "return_num_output_tokens", "ignore_eos")
OPTIONS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
           "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens") + FLAGS
# vLLM's SamplingParams fields (and TensorRT-LLM's beam_width) that ask for what this server does not do:
# the values it takes (null always)
UNSUPPORTED = {"n": (1,), "best_of": (1,), "beam_width": (1,), "use_beam_search": (False,), "logprobs": (),
               "prompt_logprobs": (), "guided_decoding": (), "allowed_token_ids": (), "bad_words": ((), [], "", [""])}


class Invalid(ValueError):
    """A request this server refuses (Triton's INVALID_ARG: HTTP 400)."""


@dataclass
class Asked:
    """One Triton request, checked: its prompt text and our engine's options."""

    text: str
    stream: bool = False
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False
    exclude_input_in_output: bool = True
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    ignored: list[str] = field(default_factory=list)  # names given that mean nothing here

    @property
    def sample(self) -> bool:
        return self.temperature > 0


def _scalar(name: str, value):
    """A tensor's one element (tensors come as lists; a [1] tensor is the scalar)."""
    if isinstance(value, list):
        if len(value) != 1:
            raise Invalid(f"`{name}` must hold one value, got {len(value)}")
        return _scalar(name, value[0])
    return value


def _int(name: str, value, low: int | None = None, high: int | None = None) -> int:
    value = _scalar(name, value)
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise Invalid(f"`{name}` must be an integer, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise Invalid(f"`{name}` must be {bounds}, got {value}")
    return value


def _float(name: str, value, low: float, high: float | None = None, low_open: bool = False) -> float:
    value = _scalar(name, value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise Invalid(f"`{name}` must be a finite number, got {value!r}")
    if value < low or (low_open and value == low) or (high is not None and value > high):
        lo = f"({low}" if low_open else f"[{low}"
        raise Invalid(f"`{name}` must be in {lo}, {high if high is not None else 'inf'}], got {value}")
    return float(value)


def _bool(name: str, value) -> bool:
    value = _scalar(name, value)
    if not isinstance(value, bool):
        raise Invalid(f"`{name}` must be a boolean, got {value!r}")
    return value


def _text(name: str, value) -> str:
    if not isinstance(value, str):
        raise Invalid(f"`{name}` must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # the model's bytes were not UTF-8 (they arrive surrogate-escaped)
        raise Invalid(f"`{name}` is not valid UTF-8") from None
    return value


def _strings(name: str, value) -> list[str]:
    values = value if isinstance(value, list) else [value]
    if len(values) > MAX_STOP:
        raise Invalid(f"`{name}` holds {len(values)} strings, at most {MAX_STOP}")
    out = [_text(name, v) for v in values]
    return [s for s in out if s]  # TensorRT-LLM clients send "" for "no stop words"


def _token_ids(name: str, value) -> list[int]:
    values = value if isinstance(value, list) else [value]
    return [_int(name, v, 0) for v in values]


def _sampling_parameters(value) -> dict:
    text = _text("sampling_parameters", _scalar("sampling_parameters", value))
    try:
        params = json.loads(text) if text.strip() else {}
    except ValueError as e:
        raise Invalid(f"`sampling_parameters` is not JSON: {e}") from None
    if not isinstance(params, dict):
        raise Invalid("`sampling_parameters` must be a JSON object")
    return params


def _refuse_unsupported(source: dict, where: str) -> None:
    for name, takes in UNSUPPORTED.items():
        value = source.get(name)
        if isinstance(value, list) and len(value) == 1 and name != "bad_words":
            value = value[0]  # a [1] tensor
        if value is not None and value not in takes:
            raise Invalid(f"`{where}{name}` {value!r} is not supported by this server")


def parse(inputs: dict, parameters: dict | None = None) -> Asked:
    """`inputs`: tensor name -> its values (a list; BYTES as str), as the model's stub sends them;
    `parameters`: the request's parameters. Invalid on anything this server cannot honour."""
    parameters = dict(parameters or {})
    if "text_input" not in inputs:
        raise Invalid("`text_input` is required")
    text = _text("text_input", _scalar("text_input", inputs["text_input"]))
    if not text:
        raise Invalid("`text_input` is empty")
    sampling = _sampling_parameters(inputs["sampling_parameters"]) if "sampling_parameters" in inputs else {}
    _refuse_unsupported(inputs, "")
    _refuse_unsupported(sampling, "sampling_parameters.")
    _refuse_unsupported(parameters, "parameters.")
    given: dict = {}
    ignored = []
    for source, prefix in ((inputs, ""), (sampling, "sampling_parameters."), (parameters, "parameters.")):
        for name, value in source.items():
            option = ALIASES.get(name, name)
            if name in ("text_input", "sampling_parameters") and source is inputs:
                continue
            if option not in OPTIONS:
                if name not in UNSUPPORTED:
                    ignored.append(prefix + name)
                continue
            if option not in given and value is not None:
                given[option] = (name, value)
    asked = Asked(text=text, ignored=ignored)
    for option, (name, value) in given.items():
        if option in FLAGS:
            setattr(asked, option, _bool(name, value))
        elif option == "max_tokens":
            asked.max_tokens = _int(name, value, 1)
        elif option in ("top_k",):
            asked.top_k = max(_int(name, value, -1), 0)  # vLLM's -1 and TensorRT-LLM's 0: no top-k
        elif option == "min_tokens":
            asked.min_tokens = _int(name, value, 0)
        elif option == "seed":
            asked.seed = _int(name, value) % SEED_MODULUS
        elif option == "temperature":
            asked.temperature = _float(name, value, 0.0)
        elif option == "top_p":
            asked.top_p = _float(name, value, 0.0, 1.0, low_open=True)
        elif option == "min_p":
            asked.min_p = _float(name, value, 0.0, 1.0)
        elif option in ("presence_penalty", "frequency_penalty"):
            setattr(asked, option, _float(name, value, -2.0, 2.0))
        elif option == "repetition_penalty":
            asked.repetition_penalty = _float(name, value, 0.0, 10.0, low_open=True)
        elif option == "stop":
            asked.stop = _strings(name, value)
        elif option == "stop_token_ids":
            asked.stop_token_ids = _token_ids(name, value)
    if asked.min_tokens > asked.max_tokens:
        raise Invalid(f"`min_tokens` ({asked.min_tokens}) must be <= `max_tokens` ({asked.max_tokens})")
    return asked

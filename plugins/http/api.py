"""The OpenAI completions and chat completions requests, checked field by field, and the
completions response bodies.

Wrong types and values the server cannot honour are refused (HTTP 400 with an OpenAI-style error
body). Fields it does not know are ignored, as vLLM does: clients add their own (Ollama's `options`,
the router's `no_stop_trim`), and refusing them makes the server unusable to those clients.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from typing import Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError,
                      model_validator)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False  # usage in every chunk (vLLM's, which guidellm asks)


Number = Union[StrictInt, StrictFloat]
MAX_N = 64          # choices per prompt
MAX_PROMPTS = 64    # prompts per request
MAX_STOP = 64       # stop strings (OpenAI takes 4, vLLM has no limit; Continue sends 7)
MAX_LOGPROBS = 20   # OpenAI's bound on `logprobs`
MAX_BIAS = 1024     # logit_bias entries
# prompt log-probabilities (echo) one answer holds: prompt tokens x n x (logprobs + 1); lm-eval's
# loglikelihood requests (logprobs 1, one prompt of a 2048-token context) take 4096
MAX_PROMPT_LOGPROBS = 1 << 18


class Sampling(BaseModel):
    """The fields completions and chat completions share: OpenAI's plus vLLM's sampling extensions.
    Fields not declared are kept in `model_extra` and ignored (the app names each once in its log)."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None  # vLLM's default: the one model served
    max_tokens: StrictInt | None = Field(default=None, ge=0)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=0)
    temperature: Number | None = Field(default=1.0, ge=0, le=2)
    top_p: Number | None = Field(default=1.0, gt=0, le=1)
    top_k: StrictInt | None = Field(default=None, ge=-1)
    min_p: Number | None = Field(default=0.0, ge=0, le=1)
    n: StrictInt | None = Field(default=1, ge=1, le=MAX_N)
    best_of: StrictInt | None = Field(default=None, ge=1)
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    stop: Union[StrictStr, list[StrictStr], None] = None
    stop_token_ids: list[StrictInt] | None = None
    seed: StrictInt | None = None
    presence_penalty: Number | None = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: Number | None = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: Number | None = Field(default=1.0, gt=0, le=10)
    logit_bias: dict[str, Number] | None = None
    min_tokens: StrictInt | None = Field(default=0, ge=0)
    ignore_eos: StrictBool | None = False
    skip_special_tokens: StrictBool | None = True  # vLLM's: special tokens (FIM, EOS) left out of the text
    user: StrictStr | None = None

    @model_validator(mode="after")
    def _one_name(self):
        """max_completion_tokens (OpenAI's newer name) is max_tokens from here on."""
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self

    def ignored(self) -> list[str]:
        names = list(self.model_extra or {})
        if self.stream_options is not None:
            names += [f"stream_options.{k}" for k in self.stream_options.model_extra or {}]
        return names

    @property
    def top_logprobs_k(self) -> int | None:
        """How many alternatives each token's log-probability comes with; None: no log-probabilities."""
        return None

    @property
    def prompt_logprobs_k(self) -> int | None:
        """The same for the prompt's tokens."""
        return None


class CompletionRequest(Sampling):
    prompt: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
    suffix: StrictStr | None = None
    echo: StrictBool | None = False
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def prompts(self) -> list:
        """One entry per prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return list(p)
        return [p]

    @model_validator(mode="after")
    def _default_max_tokens(self):
        if self.max_tokens is None:
            self.max_tokens = 16  # OpenAI's default for completions
        return self

    @property
    def top_logprobs_k(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprobs_k(self) -> int | None:
        return self.logprobs if self.echo else None


class RequestError(Exception):
    """-> an OpenAI error body with this HTTP status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


MAX_JSON_DEPTH = 32  # a completion request nests 3 deep; the parser's recursion stays far away
# a JSON string (escapes included) or one bracket: strings are skipped whole, brackets counted
_JSON_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def json_depth(raw: bytes, limit: int = MAX_JSON_DEPTH) -> int:
    """At most how deep `raw`'s arrays and objects nest, exact past `limit` (a C regex scan: cheap)."""
    depth = deepest = 0
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return min(raw.count(b"[") + raw.count(b"{"), limit)  # cannot nest deeper than it has brackets
    for match in _JSON_TOKEN.finditer(raw):
        token = match.group()
        if token in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
            if deepest > limit:
                break
        elif token in (b"]", b"}"):
            depth -= 1
    return deepest


# a JSON escape of a UTF-16 surrogate (one half of a pair, or alone): only then are the strings walked
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _lone_surrogate(value) -> bool:
    """Whether a string (key or value) in this JSON value holds a lone UTF-16 surrogate, which JSON can
    carry (\\ud800) and no tokenizer, log line or answer can encode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_lone_surrogate(k) or _lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_lone_surrogate(v) for v in value)
    return False


def read_json(raw: bytes) -> dict:
    """The request body as a JSON object of valid Unicode, or one RequestError saying why not. Every
    route reads its body here, so no text is checked again downstream."""
    if json_depth(raw) > MAX_JSON_DEPTH:
        raise RequestError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        text = raw.decode("utf-8")  # strict: json.loads(bytes) would let UTF-8-encoded surrogates through
    except UnicodeDecodeError as e:
        raise RequestError(f"the request body is not valid UTF-8 (at byte {e.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from None
    except ValueError:  # an integer past Python's int-string limit (4300 digits)
        raise RequestError("the request body holds a number too long to read (over 4300 digits)") from None
    except RecursionError:
        raise RequestError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    if not isinstance(data, dict):
        raise RequestError("the request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw):
        for key, value in data.items():
            if _lone_surrogate(key):
                raise RequestError("a field name is not valid Unicode (a lone surrogate)")
            if _lone_surrogate(value):
                raise RequestError(f"`{key}` is not valid Unicode (a lone surrogate)", key)
    return data


def validated(model: type[BaseModel], raw: bytes):
    """`raw` read as `model`; the first field error as one RequestError naming the field."""
    try:
        return model.model_validate(read_json(raw))
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if not isinstance(p, int) or len(first["loc"]) == 1)
        raise RequestError(f"`{param}`: {first['msg']}", param) from None


def parse_completion(raw: bytes) -> CompletionRequest:
    req = validated(CompletionRequest, raw)
    check_completion(req)
    return req


def check_completion(req: CompletionRequest) -> None:
    """What the field types alone do not say; one RequestError naming the field."""
    prompts = req.prompts()
    if not prompts or len(prompts) > MAX_PROMPTS:
        raise RequestError(f"`prompt` takes 1 to {MAX_PROMPTS} prompts, got {len(prompts)}", "prompt")
    if any(len(p) == 0 for p in prompts) and not req.suffix:
        raise RequestError("`prompt` is empty", "prompt")
    if req.max_tokens == 0 and not req.echo:
        raise RequestError("`max_tokens` 0 is only for scoring a prompt with `echo`", "max_tokens")
    if req.echo and req.suffix is not None:
        raise RequestError("`echo` cannot be combined with `suffix`", "echo")
    check_sampling(req)


def check_sampling(req: Sampling) -> None:
    if req.best_of not in (None, req.n):
        raise RequestError("`best_of` is not supported by this server (send n alone)", "best_of")
    if isinstance(req.stop, list) and len(req.stop) > MAX_STOP:
        raise RequestError(f"`stop` takes at most {MAX_STOP} sequences", "stop")
    if req.stop_token_ids is not None and len(req.stop_token_ids) > MAX_STOP:
        raise RequestError(f"`stop_token_ids` takes at most {MAX_STOP} ids", "stop_token_ids")
    if req.logit_bias:
        if len(req.logit_bias) > MAX_BIAS:
            raise RequestError(f"`logit_bias` takes at most {MAX_BIAS} entries", "logit_bias")
        for key, value in req.logit_bias.items():
            if not key.isdigit():
                raise RequestError(f"`logit_bias` keys are token ids, got {key!r}", "logit_bias")
            if not -100 <= value <= 100:
                raise RequestError(f"`logit_bias` values are in [-100, 100], got {value}", "logit_bias")


def stop_list(req: Sampling) -> list[str]:
    return [req.stop] if isinstance(req.stop, str) else list(req.stop or [])


def check_token_ids(ids, vocab_size: int, name: str) -> None:
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise RequestError(f"{name} token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", name)


def sampling(req: Sampling, vocab_size: int, eos: int | None) -> dict:
    """Request fields of every choice (the seed is per choice: `first_seed`): temperature 0
    is greedy; no seed draws one (OpenAI: best effort). Any integer seed is taken, reduced into
    [0, 2^63) (seed and seed + 2^63 sample alike)."""
    temperature = 1.0 if req.temperature is None else float(req.temperature)
    greedy = temperature == 0
    bias = {int(k): float(v) for k, v in (req.logit_bias or {}).items()}
    check_token_ids(bias, vocab_size, "logit_bias")
    check_token_ids(req.stop_token_ids or [], vocab_size, "stop_token_ids")
    return {"do_sample": not greedy, "temperature": 1.0 if greedy else temperature,
            "top_p": 1.0 if req.top_p is None else float(req.top_p), "top_k": max(req.top_k or 0, 0),
            "min_p": float(req.min_p or 0.0), "repetition_penalty": float(req.repetition_penalty or 1.0),
            "presence_penalty": float(req.presence_penalty or 0.0),
            "frequency_penalty": float(req.frequency_penalty or 0.0), "logit_bias": bias or None,
            "min_tokens": req.min_tokens or 0, "stop_token_ids": tuple(req.stop_token_ids or ()),
            "eos_token_id": None if req.ignore_eos else eos, "logprobs": req.top_logprobs_k,
            "prompt_logprobs": req.prompt_logprobs_k}


def first_seed(req: Sampling) -> int:
    """Choice i of a request draws from this + i: n choices differ, and each is reproducible."""
    return req.seed if req.seed is not None else secrets.randbits(62)


def completion_id() -> str:
    return "cmpl-" + secrets.token_hex(12)


def choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_body(cid: str, model: str, choices: list[dict], usage: dict | None, created: int | None = None) -> dict:
    body = {"id": cid, "object": "text_completion", "created": created or int(time.time()), "model": model,
            "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}



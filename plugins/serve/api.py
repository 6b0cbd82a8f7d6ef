"""The OpenAI completions request, checked field by field, and the response bodies.

Unknown fields, wrong types and values the server cannot honour are refused (HTTP 400 with an
OpenAI-style error body) rather than silently ignored.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from typing import Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


Number = Union[StrictInt, StrictFloat]


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    prompt: Union[StrictStr, list[StrictStr], list[StrictInt]]
    suffix: StrictStr | None = None
    max_tokens: StrictInt | None = Field(default=16, ge=1)
    temperature: Number | None = Field(default=1.0, ge=0, le=2)
    top_p: Number | None = Field(default=1.0, gt=0, le=1)
    n: StrictInt | None = Field(default=1, ge=1)
    best_of: StrictInt | None = Field(default=1, ge=1)
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    stop: Union[StrictStr, list[StrictStr], None] = None
    seed: StrictInt | None = None
    echo: StrictBool | None = False
    logprobs: StrictInt | None = None
    presence_penalty: Number | None = 0
    frequency_penalty: Number | None = 0
    logit_bias: dict[str, Number] | None = None
    user: StrictStr | None = None


class RequestError(Exception):
    """-> an OpenAI error body with this HTTP status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _unsupported(value, default, name: str, what: str) -> None:
    if value not in (None, default):
        raise RequestError(f"`{name}` is not supported by this server ({what})", name)


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


def _valid_unicode(value, name: str) -> None:
    """JSON may carry lone UTF-16 surrogates (\\ud800); no tokenizer takes them."""
    for text in [value] if isinstance(value, str) else value if isinstance(value, list) else ():
        if isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestError(f"`{name}` is not valid Unicode (a lone surrogate)", name) from None


def parse_completion(raw: bytes) -> CompletionRequest:
    if json_depth(raw) > MAX_JSON_DEPTH:
        raise RequestError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from None
    except ValueError:  # an integer past Python's int-string limit (4300 digits)
        raise RequestError("the request body holds a number too long to read (over 4300 digits)") from None
    except RecursionError:
        raise RequestError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    if not isinstance(data, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        req = CompletionRequest.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if not isinstance(p, int) or len(first["loc"]) == 1)
        if first["type"] == "extra_forbidden":
            raise RequestError(f"unknown field `{param}`", param) from None
        raise RequestError(f"`{param}`: {first['msg']}", param) from None
    for name in ("model", "prompt", "suffix", "stop", "user"):
        _valid_unicode(getattr(req, name), name)
    _unsupported(req.n, 1, "n", "one completion per request: send n = 1")
    _unsupported(req.best_of, 1, "best_of", "one completion per request")
    _unsupported(req.echo, False, "echo", "the prompt is not echoed")
    _unsupported(req.logprobs, None, "logprobs", "no log probabilities are returned")
    _unsupported(req.presence_penalty, 0, "presence_penalty", "no penalties")
    _unsupported(req.frequency_penalty, 0, "frequency_penalty", "no penalties")
    if req.logit_bias:
        raise RequestError("`logit_bias` is not supported by this server", "logit_bias")
    if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str):
        if len(req.prompt) != 1:
            raise RequestError("one prompt per request: send a string (batches of prompts are not supported)",
                               "prompt")
        req.prompt = req.prompt[0]
    if not req.prompt and not req.suffix:
        raise RequestError("`prompt` is empty", "prompt")
    if isinstance(req.stop, list) and len(req.stop) > 4:
        raise RequestError("`stop` takes at most 4 sequences", "stop")
    return req


def stop_list(req: CompletionRequest) -> list[str]:
    return [req.stop] if isinstance(req.stop, str) else list(req.stop or [])


def sampling(req: CompletionRequest) -> dict:
    """BatchRequest sampling fields: temperature 0 is greedy; no seed draws one (OpenAI: best effort).
    Any integer seed is taken, reduced into [0, 2^63) (seed and seed + 2^63 sample alike)."""
    temperature = 1.0 if req.temperature is None else float(req.temperature)
    greedy = temperature == 0
    return {"do_sample": not greedy, "temperature": 1.0 if greedy else temperature,
            "top_p": 1.0 if req.top_p is None else float(req.top_p),
            "seed": req.seed if req.seed is not None else secrets.randbits(62)}


def completion_id() -> str:
    return "cmpl-" + secrets.token_hex(12)


def completion_body(cid: str, model: str, text: str, finish_reason: str | None, usage: dict | None,
                    created: int | None = None) -> dict:
    body = {"id": cid, "object": "text_completion", "created": created or int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}
    if usage is not None:
        body["usage"] = usage
    return body


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}



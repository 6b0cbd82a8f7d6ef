"""Ollama's generate API: POST /api/generate (newline-delimited JSON stream, or one object with
`"stream": false`) and GET /api/tags, which IDE plugins with an Ollama provider speak (Twinny,
Continue, llm-ls' ollama backend).

Sampling follows Ollama's defaults where the request sets nothing (temperature 0.8, top_k 40,
top_p 0.9) and its `options` names (num_predict, temperature, top_k, top_p, min_p, seed, stop,
presence_penalty, frequency_penalty); `repeat_penalty` is taken as HF's repetition penalty over the
whole sequence (llama.cpp's looks at the last 64 tokens only).
"""

from __future__ import annotations

import json
import secrets
import time
from datetime import datetime, timezone

from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from plugins.http.api import MAX_STOP, Number, RequestError, validated
from plugins.http.served import GenerationFailed, Served


class Options(BaseModel):
    model_config = ConfigDict(extra="allow")
    num_predict: StrictInt | None = Field(default=None, ge=-2)  # -1: to the end of the context (Ollama's -2 too)
    temperature: Number | None = Field(default=0.8, ge=0, le=2)
    top_k: StrictInt | None = Field(default=40, ge=0)
    top_p: Number | None = Field(default=0.9, gt=0, le=1)
    min_p: Number | None = Field(default=0.0, ge=0, le=1)
    seed: StrictInt | None = None
    stop: list[StrictStr] | None = Field(default=None, max_length=MAX_STOP)
    repeat_penalty: Number | None = Field(default=None, gt=0, le=10)
    presence_penalty: Number | None = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: Number | None = Field(default=0.0, ge=-2, le=2)


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # keep_alive, raw, format, images, ...: ignored
    model: StrictStr | None = None
    prompt: StrictStr = ""
    suffix: StrictStr | None = None
    stream: StrictBool = True
    options: Options = Field(default_factory=Options)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


async def generate(served: Served, http, body: bytes, arrived: float):
    req = validated(GenerateRequest, body)
    o = req.options
    served.note_ignored(list(req.model_extra or {}) + [f"options.{k}" for k in o.model_extra or {}])
    served.check_model(req.model)
    if not req.prompt and req.suffix is None:
        raise RequestError("`prompt` is empty", "prompt")
    prompt = await served.prompt_ids(req.prompt, req.suffix)
    if o.num_predict == 0:
        raise RequestError("`options.num_predict` must be >= 1 (or -1: to the end of the context)",
                           "options.num_predict")
    max_tokens = served.capacity - len(prompt) if o.num_predict is None or o.num_predict < 0 else o.num_predict
    temperature = 0.8 if o.temperature is None else float(o.temperature)
    params = served.request(
        prompt=prompt, max_tokens=max_tokens, do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else 1.0, top_k=o.top_k or 0,
        top_p=float(o.top_p or 1.0), min_p=float(o.min_p or 0.0),
        seed=o.seed if o.seed is not None else secrets.randbits(62), eos_token_id=served.eos,
        repetition_penalty=float(o.repeat_penalty or 1.0), presence_penalty=float(o.presence_penalty or 0.0),
        frequency_penalty=float(o.frequency_penalty or 0.0))
    gen = served.start([params], list(o.stop or []), arrived, names={"max_tokens": "options.num_predict"})[0]
    model = served.model_id
    started = time.monotonic()

    def last(reason: str) -> dict:
        took = int((time.monotonic() - started) * 1e9)
        return {"model": model, "created_at": _now(), "response": "", "done": True, "done_reason": reason,
                "prompt_eval_count": len(prompt), "eval_count": gen.completion_tokens, "total_duration": took}

    def reason_of(event) -> str:
        return "length" if event.finish == "length" else "stop"

    if req.stream:
        async def lines():
            try:
                async for event in gen.events():
                    if event.text:
                        yield json.dumps({"model": model, "created_at": _now(), "response": event.text,
                                          "done": False}) + "\n"
                    if event.finish:
                        yield json.dumps(last(reason_of(event))) + "\n"
            except GenerationFailed as exc:
                yield json.dumps({"error": exc.message}) + "\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    parts, reason = [], "stop"
    try:
        async for event in gen.events():
            parts.append(event.text)
            if event.finish:
                reason = reason_of(event)
    except GenerationFailed as exc:
        raise exc.error() from None
    return {**last(reason), "response": "".join(parts)}


def tags(served: Served) -> dict:
    """The one served model, as /api/tags lists models."""
    return {"models": [{"name": served.model_id, "model": served.model_id,
                        "modified_at": datetime.fromtimestamp(served.created, timezone.utc).isoformat(),
                        "size": 0, "details": {"family": "gpt_bigcode", "format": "safetensors"}}]}

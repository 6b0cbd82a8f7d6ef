"""Text Generation Inference's API: POST /generate and POST /generate_stream, the shapes of TGI's
router (GenerateRequest, GenerateParameters, GenerateResponse, StreamResponse), which llm-ls (behind
llm-vscode) and huggingface_hub's InferenceClient speak.

TGI samples when `do_sample` is set or any warper is (temperature != 1, top_k, top_p < 1), as its
NextTokenChooser does; otherwise it is greedy.
"""

from __future__ import annotations

import json
import secrets

from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from plugins.serve.api import MAX_STOP, Number, RequestError, validated
from plugins.serve.served import GenerationFailed, Served

class Parameters(BaseModel):
    model_config = ConfigDict(extra="allow")
    max_new_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: Number | None = Field(default=None, gt=0)
    top_p: Number | None = Field(default=None, gt=0, le=1)
    top_k: StrictInt | None = Field(default=None, ge=0)
    do_sample: StrictBool = False
    repetition_penalty: Number | None = Field(default=None, gt=0)
    frequency_penalty: Number | None = Field(default=None, ge=-2, le=2)
    stop: list[StrictStr] = Field(default_factory=list, max_length=MAX_STOP)
    return_full_text: StrictBool | None = False
    seed: StrictInt | None = Field(default=None, ge=0)
    details: StrictBool = False
    decoder_input_details: StrictBool = False
    top_n_tokens: StrictInt | None = Field(default=None, ge=0, le=20)
    best_of: StrictInt | None = Field(default=None, ge=1, le=1)
    typical_p: Number | None = Field(default=None, ge=1, le=1)  # only "off": no typical sampling here
    watermark: StrictBool = False


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    inputs: StrictStr
    # TGI's default_parameters(), when the body has none, sample (do_sample true)
    parameters: Parameters = Field(default_factory=lambda: Parameters(do_sample=True))
    stream: StrictBool = False


def _finish(event) -> str:
    if event.finish == "length":
        return "length"
    return "stop_sequence" if event.stopped_by_text else "eos_token"


async def _start(served: Served, body: bytes, arrived: float, stream: bool = False):
    req = validated(GenerateRequest, body, ("inputs",))
    stream = stream or req.stream
    p = req.parameters
    if p.watermark:
        raise RequestError("`parameters.watermark` is not supported by this server", "parameters.watermark")
    served.note_ignored(list(req.model_extra or {}) + [f"parameters.{k}" for k in p.model_extra or {}])
    if not req.inputs:
        raise RequestError("`inputs` is empty", "inputs")
    prompt = await served.prompt_ids(req.inputs, name="inputs")
    max_new = p.max_new_tokens or served.capacity - len(prompt)  # TGI: up to the context when not given
    served.check_fits(prompt, max(max_new, 1), "parameters.max_new_tokens")
    temperature = 1.0 if p.temperature is None else float(p.temperature)
    sample = p.do_sample or temperature != 1.0 or bool(p.top_k) or (p.top_p or 1.0) < 1.0
    seed = p.seed if p.seed is not None else secrets.randbits(62)
    params = served.request(
        prompt=prompt, max_new_tokens=max_new, do_sample=sample, temperature=temperature if sample else 1.0,
        top_k=p.top_k or 0, top_p=float(p.top_p or 1.0), seed=seed, eos_token_id=served.eos,
        repetition_penalty=float(p.repetition_penalty or 1.0), frequency_penalty=float(p.frequency_penalty or 0.0),
        # token logprobs only where the answer carries them (else plain greedy rows stay one batch argmax)
        logprobs=p.top_n_tokens or 0 if stream or p.details or p.top_n_tokens else None,
        prompt_logprobs=0 if p.decoder_input_details else None)
    return req, params, served.start([params], p.stop, arrived)[0]


def _token(served: Served, token: int, entry, text: str | None = None) -> dict:
    special = token == served.eos
    return {"id": token, "text": served.tokenizer.decode([token], skip_special_tokens=False) if text is None else text,
            "logprob": None if entry is None else entry[0], "special": special}


def _top(served: Served, entry) -> list[dict]:
    return [] if entry is None else [_token(served, t, (v, None)) for t, v in entry[1]]


def _prefill(served: Served, prompt: list[int], entries) -> list[dict]:
    entries = [None] + list(entries or [])
    return [{"id": t, "text": served.tokenizer.decode([t], skip_special_tokens=False),
             "logprob": None if e is None else e[0]} for t, e in zip(prompt, entries)]


async def generate(served: Served, http, body: bytes, arrived: float):
    req, params, gen = await _start(served, body, arrived)
    if req.stream:
        return _stream(served, req, params, gen)
    parts, tokens, finish = [], [], None
    try:
        async for event in gen.events():
            parts.append(event.text)
            tokens += [(t, e) for t, e in zip(event.tokens, event.logprobs or [None] * len(event.tokens))]
            if event.finish:
                finish = _finish(event)
    except GenerationFailed as exc:
        raise exc.error() from None
    text = "".join(parts)
    out = {"generated_text": (req.inputs + text) if req.parameters.return_full_text else text}
    if req.parameters.details:
        out["details"] = {
            "finish_reason": finish, "generated_tokens": len(tokens), "seed": params.seed if params.do_sample else None,
            "prefill": _prefill(served, params.prompt, gen.prompt_logprobs) if req.parameters.decoder_input_details
            else [], "tokens": [_token(served, t, e) for t, e in tokens],
            "top_tokens": [_top(served, e) for _, e in tokens] if req.parameters.top_n_tokens else None}
    return out


async def generate_stream(served: Served, http, body: bytes, arrived: float):
    req, params, gen = await _start(served, body, arrived, stream=True)
    return _stream(served, req, params, gen)


def _stream(served: Served, req: GenerateRequest, params, gen) -> StreamingResponse:
    """One event per token: its text where that text is final (the last token of a step carries the
    step's text), `generated_text` and `details` on the last."""
    async def events():
        index, parts = 0, []
        try:
            async for event in gen.events():
                parts.append(event.text)
                entries = event.logprobs or [None] * len(event.tokens)
                for k, (token, entry) in enumerate(zip(event.tokens, entries)):
                    index += 1
                    last_of_step = k == len(event.tokens) - 1
                    out = {"index": index, "token": _token(served, token, entry, event.text if last_of_step else ""),
                           "top_tokens": _top(served, entry), "generated_text": None, "details": None}
                    if last_of_step and event.finish:
                        text = "".join(parts)
                        out["generated_text"] = (req.inputs + text) if req.parameters.return_full_text else text
                        out["details"] = {"finish_reason": _finish(event), "generated_tokens": gen.completion_tokens,
                                          "seed": params.seed if params.do_sample else None,
                                          "input_length": len(params.prompt)}
                    yield f"data:{json.dumps(out, separators=(',', ':'))}\n\n"
        except GenerationFailed as exc:
            yield f"data:{json.dumps({'error': exc.message, 'error_type': 'generation'})}\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

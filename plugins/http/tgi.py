"""Text Generation Inference's API: POST /generate, POST /generate_stream, its compat route POST /
(either, by `stream`; the non-streamed answer wrapped in a list, as TGI does for the Inference API
shape) and GET /info, in the shapes of TGI's router (GenerateRequest, GenerateParameters,
GenerateResponse, StreamResponse, Info, ErrorResponse), which TGI's own Python client
(`text_generation.Client`, speaking to /), huggingface_hub's InferenceClient and llm-ls (behind
llm-vscode) speak.

TGI samples when `do_sample` is set or any warper is (temperature != 1, top_k, top_p < 1), as its
NextTokenChooser does; otherwise it is greedy. `best_of` n samples n sequences (seeds seed .. seed + n
- 1, one shared prefill) and answers the one whose tokens have the highest summed log-probability,
the others in `details.best_of_sequences`. `truncate` keeps the prompt's last tokens.
"""

from __future__ import annotations

import json
import secrets
from importlib.metadata import version

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from plugins.http.api import MAX_N, MAX_STOP, Number, RequestError, validated
from plugins.http.served import GenerationFailed, Served, merged


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
    best_of: StrictInt | None = Field(default=None, ge=1, le=MAX_N)
    truncate: StrictInt | None = Field(default=None, ge=1)
    typical_p: Number | None = Field(default=None, ge=1, le=1)  # only "off": no typical sampling here
    watermark: StrictBool = False
    grammar: dict | None = None
    adapter_id: StrictStr | None = None


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    inputs: StrictStr
    # TGI's default_parameters(), when the body has none, sample (do_sample true)
    parameters: Parameters = Field(default_factory=lambda: Parameters(do_sample=True))
    stream: StrictBool = False


NAMES = {"max_tokens": "parameters.max_new_tokens", "n": "parameters.best_of"}  # the engine's -> TGI's


def error_response(exc: RequestError) -> JSONResponse:
    """TGI's ErrorResponse body ({error, error_type}), by which its client picks the exception it raises."""
    kind = "overloaded" if exc.status in (429, 503) else "generation" if exc.status >= 500 else "validation"
    headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
    return JSONResponse({"error": exc.message, "error_type": kind}, status_code=exc.status, headers=headers)


def _finish(event) -> str:
    if event.finish == "length":
        return "length"
    return "stop_sequence" if event.stopped_by_text else "eos_token"


def _refuse_unsupported(p: Parameters, stream: bool, sample: bool) -> None:
    for name, unsupported in (("watermark", p.watermark), ("grammar", p.grammar is not None),
                              ("adapter_id", p.adapter_id is not None)):
        if unsupported:
            raise RequestError(f"`parameters.{name}` is not supported by this server", f"parameters.{name}")
    if (p.best_of or 1) > 1:  # TGI's own rules for best_of
        if stream:
            raise RequestError("`parameters.best_of` > 1 cannot stream", "parameters.best_of")
        if p.seed is not None:
            raise RequestError("`parameters.seed` must not be set when `best_of` > 1", "parameters.seed")
        if not sample:
            raise RequestError("`parameters.best_of` > 1 needs sampling (do_sample, temperature, top_k or top_p)",
                               "parameters.best_of")


async def _start(served: Served, req: GenerateRequest, arrived: float, stream: bool):
    p = req.parameters
    temperature = 1.0 if p.temperature is None else float(p.temperature)
    sample = p.do_sample or temperature != 1.0 or bool(p.top_k) or (p.top_p or 1.0) < 1.0
    _refuse_unsupported(p, stream, sample)
    served.note_ignored(list(req.model_extra or {}) + [f"parameters.{k}" for k in p.model_extra or {}])
    if not req.inputs:
        raise RequestError("`inputs` is empty", "inputs")
    prompt = await served.prompt_ids(req.inputs, name="inputs")
    if p.truncate is not None:
        prompt = prompt[-p.truncate:]
    max_tokens = p.max_new_tokens or served.capacity - len(prompt)  # TGI: up to the context when not given
    seed = p.seed if p.seed is not None else secrets.randbits(62)
    best_of = p.best_of or 1
    # token logprobs only where the answer carries or ranks by them (else greedy rows stay one batch argmax)
    logprobs = p.top_n_tokens or 0 if stream or p.details or p.top_n_tokens or best_of > 1 else None
    params = [served.request(
        prompt=prompt, max_tokens=max_tokens, do_sample=sample, temperature=temperature if sample else 1.0,
        top_k=p.top_k or 0, top_p=float(p.top_p or 1.0), seed=seed + j, eos_token_id=served.eos,
        repetition_penalty=float(p.repetition_penalty or 1.0), frequency_penalty=float(p.frequency_penalty or 0.0),
        logprobs=logprobs, prompt_logprobs=0 if p.decoder_input_details else None) for j in range(best_of)]
    # TGI's text ends with the stop sequence
    return params, served.start(params, p.stop, arrived, include_stop=True, names=NAMES)


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


class _Sequence:
    """One generated sequence of a /generate answer, collected from its events."""

    def __init__(self):
        self.parts: list[str] = []
        self.tokens: list[tuple[int, tuple | None]] = []
        self.finish: str | None = None

    def take(self, event) -> None:
        self.parts.append(event.text)
        self.tokens += list(zip(event.tokens, event.logprobs or [None] * len(event.tokens)))
        if event.finish:
            self.finish = _finish(event)

    @property
    def logprob(self) -> float:
        return sum(e[0] for _, e in self.tokens if e is not None)

    def details(self, served: Served, req: GenerateRequest, params, gen) -> dict:
        """TGI's Details fields but best_of_sequences (a BestOfSequence is these and generated_text)."""
        p = req.parameters
        return {"finish_reason": self.finish, "generated_tokens": len(self.tokens),
                "seed": params.seed if params.do_sample else None,
                "prefill": _prefill(served, params.prompt, gen.prompt_logprobs) if p.decoder_input_details else [],
                "tokens": [_token(served, t, e) for t, e in self.tokens],
                "top_tokens": [_top(served, e) for _, e in self.tokens] if p.top_n_tokens else None}

    def text(self, req: GenerateRequest) -> str:
        text = "".join(self.parts)
        return req.inputs + text if req.parameters.return_full_text else text


async def generate(served: Served, http, body: bytes, arrived: float, compat: bool = False):
    req = validated(GenerateRequest, body)
    if compat and "return_full_text" not in req.parameters.model_fields_set:
        req.parameters.return_full_text = True  # TGI's compat route, for a text-generation model
    params, gens = await _start(served, req, arrived, req.stream)
    if req.stream:
        return _stream(served, req, params[0], gens[0])
    sequences = [_Sequence() for _ in gens]
    try:
        async for i, event in merged(gens):
            sequences[i].take(event)
    except GenerationFailed as exc:
        raise exc.error() from None
    best = max(range(len(gens)), key=lambda i: sequences[i].logprob)
    out = {"generated_text": sequences[best].text(req)}
    if req.parameters.details:
        out["details"] = sequences[best].details(served, req, params[best], gens[best])
        if len(gens) > 1:
            out["details"]["best_of_sequences"] = [
                {"generated_text": sequences[i].text(req), **sequences[i].details(served, req, params[i], gens[i])}
                for i in range(len(gens)) if i != best]
    return [out] if compat else out


async def generate_stream(served: Served, http, body: bytes, arrived: float):
    req = validated(GenerateRequest, body)
    params, gens = await _start(served, req, arrived, stream=True)
    return _stream(served, req, params[0], gens[0])


async def compat_generate(served: Served, http, body: bytes, arrived: float):
    """POST /: TGI's route for its Python client and the Inference API."""
    return await generate(served, http, body, arrived, compat=True)


def info(served: Served, max_concurrent: int) -> dict:
    """GET /info: TGI's Info fields."""
    return {"model_id": served.model_id, "model_sha": None, "model_pipeline_tag": "text-generation",
            "max_concurrent_requests": max_concurrent, "max_best_of": MAX_N, "max_stop_sequences": MAX_STOP,
            "max_input_tokens": served.capacity - 1, "max_total_tokens": served.capacity, "validation_workers": 1,
            "max_client_batch_size": 1, "router": "mqa-plugins", "version": version("mqa-inference-plugins"),
            "sha": None,
            "docker_label": None}


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

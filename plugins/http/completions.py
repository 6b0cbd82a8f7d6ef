"""POST /v1/completions: several prompts, n choices each, echo, log-probabilities, streaming.

Choice `p * n + j` is choice j of prompt p (vLLM's order); its seed is seed + j. The n choices of a
prompt are queued together, so the batch prefills the prompt once and copies its KV into n rows.
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from plugins.http.api import (MAX_PROMPT_LOGPROBS, CompletionRequest, RequestError, Sampling, choice, completion_body,
                               completion_id, first_seed, parse_completion, sampling, stop_list, usage)
from plugins.http.served import Generation, GenerationFailed, Served, merged


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class Logprobs:
    """OpenAI's `logprobs` object of one choice (tokens, token_logprobs, top_logprobs, text_offset),
    built as tokens come; the sampled token is always among its top_logprobs (as vLLM does)."""

    def __init__(self, tokenizer):
        self.tok, self.offset = tokenizer, 0
        self.body = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add(self, ids: list[int], entries: list) -> dict:
        """Tokens `ids` with their (logprob, [(id, logprob)]) entries (None: no logprob, the first
        prompt token); returns the part for these tokens, also kept in `body`."""
        part = {key: [] for key in self.body}
        for token, entry in zip(ids, entries):
            text = self.tok.decode([token], skip_special_tokens=False)
            part["tokens"].append(text)
            part["text_offset"].append(self.offset)
            self.offset += len(text)
            if entry is None:
                part["token_logprobs"].append(None)
                part["top_logprobs"].append(None)
                continue
            value, top = entry
            alternatives = {self.tok.decode([t], skip_special_tokens=False): v for t, v in top}
            alternatives.setdefault(text, value)
            part["token_logprobs"].append(value)
            part["top_logprobs"].append(alternatives)
        for key, values in part.items():
            self.body[key].extend(values)
        return part


class Choice:
    """One choice's text and logprobs, echo first where asked."""

    def __init__(self, served: Served, gen: Generation, prompt: list[int], prompt_text: str, req: CompletionRequest):
        self.gen, self.prompt, self.prompt_text = gen, prompt, prompt_text
        self.echo, self.scoring = bool(req.echo), req.max_tokens == 0
        self.logprobs = Logprobs(served.tokenizer) if req.logprobs is not None else None
        self.started = False
        self.parts: list[str] = []
        self.finish: str | None = None

    @property
    def completion_tokens(self) -> int:
        return 0 if self.scoring else self.gen.completion_tokens

    def take(self, event) -> tuple[str, dict | None]:
        """The text and logprobs part this event adds to the choice."""
        text, part = "", None
        if not self.started:
            self.started = True
            if self.echo:
                text = self.prompt_text
                if self.logprobs is not None:
                    entries = [None] + list(self.gen.prompt_logprobs or [None] * (len(self.prompt) - 1))
                    part = self.logprobs.add(self.prompt, entries)
        if not self.scoring:
            text += event.text
            if self.logprobs is not None and event.tokens:
                new = self.logprobs.add(event.tokens, event.logprobs or [None] * len(event.tokens))
                part = new if part is None else {k: part[k] + new[k] for k in part}
        if event.finish:
            self.finish = "length" if self.scoring else event.finish
        self.parts.append(text)
        return text, part


async def create_completion(served: Served, http: HTTPRequest, body: bytes, arrived: float):
    req = parse_completion(body)
    served.note_ignored(req.ignored())
    served.check_model(req.model)
    prompts = [await served.prompt_ids(p, req.suffix) for p in req.prompts()]
    check_prompt_logprobs(req, prompts)
    texts = [p if isinstance(p, str) else served.tokenizer.decode(p, skip_special_tokens=req.skip_special_tokens
                                                                   is not False) for p in req.prompts()]
    gens = start_choices(served, req, prompts, max(req.max_tokens, 1), arrived)  # max_tokens 0 (echo):
    # one token is made and dropped
    pairs = [(ids, text) for ids, text in zip(prompts, texts) for _ in range(req.n or 1)]
    choices = [Choice(served, gen, ids, text, req) for gen, (ids, text) in zip(gens, pairs)]
    cid, created, model = completion_id(), int(time.time()), served.model_id
    prompt_tokens = sum(len(ids) for ids in prompts)

    def current_usage():
        return usage(prompt_tokens, sum(c.completion_tokens for c in choices))

    if req.stream:
        options = req.stream_options
        continuous = bool(options and options.continuous_usage_stats)

        async def chunks():
            async for i, event in merged(gens):
                text, part = choices[i].take(event)
                if text or part or choices[i].finish:
                    yield completion_body(cid, model, [choice(i, text, choices[i].finish, part)],
                                          current_usage() if continuous else None, created)

        final = (lambda: completion_body(cid, model, [], current_usage(), created)) \
            if options and options.include_usage else None
        return sse_response(cid, chunks(), final)

    await collect(http, gens, lambda i, event: choices[i].take(event))
    return completion_body(cid, model, [choice(i, "".join(c.parts), c.finish, c.logprobs and c.logprobs.body)
                                        for i, c in enumerate(choices)], current_usage(), created)


def check_prompt_logprobs(req: CompletionRequest, prompts: list[list[int]]) -> None:
    """Bound what `echo` with `logprobs` costs before any of it is computed: each prompt token of each
    choice comes with k + 1 log-probabilities, all in one answer."""
    k = req.prompt_logprobs_k
    if k is None:
        return
    entries = (req.n or 1) * sum(len(ids) for ids in prompts) * (k + 1)
    if entries > MAX_PROMPT_LOGPROBS:
        raise RequestError(f"`echo` with `logprobs` {k} over {sum(map(len, prompts))} prompt tokens x n {req.n or 1} "
                           f"asks for {entries} prompt log-probabilities; this server answers at most "
                           f"{MAX_PROMPT_LOGPROBS} per request (prompt tokens x n x (logprobs + 1)): send fewer "
                           "prompts per request or a smaller `logprobs`", "logprobs")


def sse_response(cid: str, chunks, final=None) -> StreamingResponse:
    """Server-sent events: each chunk, then `final()` (the usage chunk) where given, then [DONE]. A
    failure ends the stream alone with an error event (and [DONE], as always)."""
    async def events():
        try:
            async for chunk in chunks:
                yield sse(chunk)
        except GenerationFailed as exc:
            yield sse(exc.error().body())
            yield "data: [DONE]\n\n"
            return
        except Exception as exc:  # e.g. detokenizing raised: this stream ends alone, with an error event
            print(f"stream {cid} failed: {type(exc).__name__}: {exc}", flush=True)
            yield sse(RequestError("internal server error", status=500, kind="server_error").body())
            yield "data: [DONE]\n\n"
            return
        if final is not None:
            yield sse(final())
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def collect(http: HTTPRequest, gens: list[Generation], take) -> None:
    """Every event of a non-streaming answer into `take(i, event)`; the client leaving cancels all."""
    watcher = asyncio.create_task(cancel_on_disconnect(http, gens))
    try:
        async for i, event in merged(gens):
            take(i, event)
    except GenerationFailed as exc:
        raise exc.error() from None
    finally:
        watcher.cancel()


def start_choices(served: Served, req: Sampling, prompts: list[list[int]], max_tokens: int,
                  arrived: float) -> list[Generation]:
    """n generations per prompt, queued together (choice p * n + j: seed + j); all or none."""
    return served.start(choice_requests(served, req, prompts, max_tokens), stop_list(req), arrived,
                        skip_special=req.skip_special_tokens is not False)


def choice_requests(served: Served, req: Sampling, prompts: list[list[int]], max_tokens: int) -> list:
    fields = sampling(req, served.vocab_size, served.eos)
    seed = first_seed(req)
    return [served.request(prompt=ids, max_tokens=max_tokens, seed=seed + j, **fields)
            for ids in prompts for j in range(req.n or 1)]


async def cancel_on_disconnect(http: HTTPRequest, gens: list[Generation]) -> None:
    """A non-streaming client that leaves frees its slots at the next step: once the body is read,
    the next ASGI message is the disconnect."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
    for gen in gens:
        gen.cancel()

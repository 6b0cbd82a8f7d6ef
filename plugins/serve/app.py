"""The HTTP server: OpenAI-compatible `/v1/completions` (streaming or not), `/v1/models`, `/health`,
Prometheus `/metrics`, on FastAPI.

The event loop tokenizes prompts (in a worker thread), queues requests with the scheduler and
turns the token ids it streams back into text; the decode loop runs in the scheduler's thread.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from plugins.core.config import ConfigError
from plugins.serve.api import RequestError, completion_body, completion_id, parse_completion, sampling, stop_list, usage
from plugins.serve.text import EOS_NAMES, StreamText, encode_prompt, special_id
from plugins.serving.batching import BatchRequest
from plugins.serving.scheduler import QueueFull, Request, Scheduler, ServerClosing

MAX_BODY_BYTES = 4 << 20


def max_token_bytes(tokenizer) -> int | None:
    """An upper bound on the UTF-8 bytes of text one token stands for: a byte-level BPE token's string
    has one character per byte, and each character is at least one byte in UTF-8. None where a
    normalizer could shrink text before it is split (then no bound holds)."""
    if tokenizer.normalizer is not None:
        return None
    return max((len(t.encode("utf-8")) for t in tokenizer.get_vocab(with_added_tokens=True)), default=1)


class Served:
    """What the app serves: the scheduler (over an open backend), its tokenizer and the model id."""

    def __init__(self, scheduler: Scheduler, tokenizer, model_id: str, vocab_size: int,
                 max_body_bytes: int = MAX_BODY_BYTES):
        self.scheduler, self.tokenizer, self.model_id, self.vocab_size = scheduler, tokenizer, model_id, vocab_size
        self.eos = special_id(tokenizer, EOS_NAMES)
        self.created = int(time.time())
        self.max_body_bytes = max_body_bytes
        per_token = max_token_bytes(tokenizer)
        # a prompt (+ suffix) of more bytes than this cannot fit the context: refused before tokenizing
        self.max_prompt_bytes = None if per_token is None else per_token * (scheduler.capacity - 1)


def create_app(served: Served, on_shutdown=None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        yield
        # uvicorn has stopped accepting and waited for open requests (its graceful timeout)
        await run_in_threadpool(served.scheduler.close)
        if on_shutdown is not None:
            await run_in_threadpool(on_shutdown)
        print(f"server shut down: backend closed, {served.scheduler.failed_at_close} unfinished request(s) "
              "failed", flush=True)

    app = FastAPI(title="mqa-plugins completions server", lifespan=lifespan)
    sched = served.scheduler

    @app.exception_handler(RequestError)
    async def request_error(_, exc: RequestError):
        headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(_, exc: HTTPException):  # 404, 405, ...: OpenAI's body too
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(RequestError(str(exc.detail), status=exc.status_code, kind=kind).body(),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(http: HTTPRequest, exc: Exception):  # a bug of ours: one log line, a body, no traceback
        print(f"unexpected error on {http.method} {http.url.path}: {type(exc).__name__}: {exc}", flush=True)
        return JSONResponse(RequestError("internal server error", status=500, kind="server_error").body(),
                            status_code=500)

    @app.get("/health")
    async def health():
        state = sched.state()
        status = 503 if state["error"] else 200
        return JSONResponse({"status": "ok" if status == 200 else "error", **state}, status_code=status)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(sched.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.model_id, "object": "model", "created": served.created,
                                            "owned_by": "mqa-plugins", "max_model_len": sched.capacity}]}

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        arrived = time.monotonic()  # TTFT counts tokenization and queueing too
        limit = served.max_body_bytes
        too_big = RequestError(f"request body over {limit} bytes (--max-body-bytes)", status=413)
        declared = http.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_big
        body = bytearray()
        try:
            async for chunk in http.stream():
                body += chunk
                if len(body) > limit:
                    raise too_big
        except ClientDisconnect:  # gone mid-body (or cut by the read deadline): nobody to answer
            return Response(status_code=400)
        req = parse_completion(bytes(body))
        if req.model != served.model_id:
            raise RequestError(f"model {req.model!r} does not exist; this server serves {served.model_id!r}",
                               "model", status=404, code="model_not_found")
        prompt = await prompt_ids(req)
        max_tokens = req.max_tokens or 16
        if len(prompt) + max_tokens > sched.capacity:
            raise RequestError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds this model's "
                               f"context of {sched.capacity} tokens", "max_tokens")
        params = BatchRequest(id=sched.new_id(), prompt=prompt, max_new_tokens=max_tokens,
                              eos_token_id=served.eos, **sampling(req))
        entry = Request(params, asyncio.get_running_loop(), arrived=arrived)
        try:
            sched.submit(entry)
        except (QueueFull, ServerClosing) as e:
            raise RequestError(str(e), status=503, kind="server_error", code="overloaded") from None
        except ConfigError as e:
            raise RequestError(str(e)) from None
        text = StreamText(served.tokenizer, stop_list(req), skip_ids={served.eos} - {None})
        cid, created = completion_id(), int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def done_usage():
            return usage(len(prompt), len(text.ids))

        if req.stream:
            async def events():
                try:
                    async for piece, reason in pieces(entry, text, http):
                        if reason == "error":  # an error event, then the end of the stream as always
                            yield sse(failure(piece).body())
                            yield "data: [DONE]\n\n"
                            return
                        yield sse(completion_body(cid, served.model_id, piece, reason, None, created))
                except Exception as exc:  # e.g. detokenizing this stream raised: it ends alone, with an error event
                    print(f"stream {cid} failed: {type(exc).__name__}: {exc}", flush=True)
                    yield sse(RequestError("internal server error", status=500, kind="server_error").body())
                    yield "data: [DONE]\n\n"
                    return
                if include_usage:
                    body = completion_body(cid, served.model_id, "", None, done_usage(), created)
                    body["choices"] = []
                    yield sse(body)
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        parts, finish = [], None
        watcher = asyncio.create_task(cancel_on_disconnect(http, entry))
        try:
            async for piece, reason in pieces(entry, text, http):
                if reason == "error":
                    raise failure(piece)
                parts.append(piece)
                finish = reason or finish
        finally:
            watcher.cancel()
        return completion_body(cid, served.model_id, "".join(parts), finish, done_usage(), created)

    def failure(message: str) -> RequestError:
        closing = message.startswith("the server is shutting down")
        return RequestError(message, status=503 if closing else 500, kind="server_error")

    async def cancel_on_disconnect(http: HTTPRequest, entry: Request) -> None:
        """A non-streaming client that leaves frees its slot at the next step: once the body is read,
        the next ASGI message is the disconnect."""
        while (await http.receive())["type"] != "http.disconnect":
            pass
        sched.cancel(entry.params.id)

    async def prompt_ids(req) -> list[int]:
        if served.max_prompt_bytes is not None and isinstance(req.prompt, str):
            size = len(req.prompt.encode()) + len((req.suffix or "").encode())
            if size > served.max_prompt_bytes:
                raise RequestError(f"`prompt` is {size} bytes: more than {sched.capacity - 1} tokens of this "
                                   f"model's context can hold (at most {served.max_prompt_bytes} bytes)", "prompt")
        if isinstance(req.prompt, list):  # token ids
            if req.suffix is not None:
                raise RequestError("`suffix` needs a text prompt, not token ids", "suffix")
            bad = [i for i in req.prompt if not 0 <= i < served.vocab_size]
            if bad:
                raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary (0..{served.vocab_size - 1})",
                                   "prompt")
            return list(req.prompt)
        try:
            ids = await run_in_threadpool(encode_prompt, served.tokenizer, req.prompt, req.suffix)
        except ValueError as e:
            raise RequestError(str(e), "suffix") from None
        if not ids:
            raise RequestError("`prompt` encodes to no tokens", "prompt")
        return ids

    async def pieces(entry: Request, text: StreamText, http: HTTPRequest):
        """(text, None) as text becomes final, then (text, finish_reason); ("message", "error") on failure.
        Leaving early (client gone, stop string) drops the request from the batch."""
        finished = False
        try:
            while True:
                kind, value = await entry.queue.get()
                if kind == "tokens":
                    piece = text.add(value)
                    if text.stopped:
                        yield piece, "stop"
                        return
                    if piece:
                        yield piece, None
                elif kind == "done":
                    finished = True
                    yield text.flush(), ("stop" if value == "cancelled" else value)
                    return
                else:
                    finished = True
                    yield value, "error"
                    return
        finally:
            if not finished:
                sched.cancel(entry.params.id)

    return app


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

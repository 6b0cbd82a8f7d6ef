"""The HTTP server on FastAPI: OpenAI-compatible `/v1/completions` (plugins.http.completions) and
`/v1/chat/completions` (plugins.http.chat),
TGI's `/generate`, `/generate_stream`, `/` and `/info` (plugins.http.tgi), Ollama's `/api/generate` and
`/api/tags` (plugins.http.ollama), vLLM's `/tokenize`, `/detokenize`, `/tokenizer_info` and the
render endpoints (plugins.http.render), `/v1/models`, `/health`, Prometheus `/metrics`, and `/get_load`
(requests held, for routers that balance by load: vllm-router's and sglang-router's power_of_two policy).
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from plugins.http import ollama, render, tgi, tokens
from plugins.http.api import RequestError
from plugins.http.chat import create_chat_completion
from plugins.http.completions import create_completion
from plugins.http.http_limits import RefuseAmbiguousFraming
from plugins.http.served import Served

__all__ = ["Served", "create_app"]


def create_app(served: Served, on_shutdown=None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        yield
        # uvicorn has stopped accepting and waited for open requests (its graceful timeout)
        await run_in_threadpool(served.engine.close)
        if on_shutdown is not None:
            await run_in_threadpool(on_shutdown)
        print(f"server shut down: backend closed, {served.engine.failed_at_close} unfinished request(s) "
              "failed", flush=True)

    app = FastAPI(title="mqa-plugins completions server", lifespan=lifespan)
    app.add_middleware(RefuseAmbiguousFraming)
    engine = served.engine

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
        state = engine.state()
        status = 503 if state["error"] else 200
        return JSONResponse({"status": "ok" if status == 200 else "error", **state}, status_code=status)

    @app.get("/get_load")
    async def load():
        state = engine.state()
        return {"load": state["running"] + state["waiting"], "num_reqs": state["running"],
                "num_waiting_reqs": state["waiting"]}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.model_id, "object": "model", "created": served.created,
                                            "owned_by": "mqa-plugins", "max_model_len": engine.capacity}]}

    async def read_body(http: HTTPRequest) -> bytes | None:
        """The whole body, or None when the client left mid-body (or was cut by the read deadline)."""
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
        except ClientDisconnect:
            return None
        return bytes(body)

    def route(path: str, handler, error_response=None):
        """`error_response(RequestError)`: the route's own error body (TGI's), else OpenAI's."""
        async def endpoint(http: HTTPRequest):
            arrived = time.monotonic()  # TTFT counts reading, tokenization and queueing too
            arrival = None
            try:
                body = await read_body(http)
                if body is None:  # nobody to answer
                    return Response(status_code=400)
                # read: the engine's next step may wait for it (a slow body holds nobody up)
                arrival = served.arrival()  # done when the handler queues it (Served.start), at the latest below
                return await handler(served, http, body, arrived)
            except RequestError as exc:
                if error_response is None:
                    raise
                return error_response(exc)
            finally:
                if arrival is not None:
                    arrival.done()

        app.add_api_route(path, endpoint, methods=["POST"], name=path)

    route("/v1/completions", create_completion)
    route("/v1/chat/completions", create_chat_completion)
    route("/", tgi.compat_generate, tgi.error_response)
    route("/generate", tgi.generate, tgi.error_response)
    route("/generate_stream", tgi.generate_stream, tgi.error_response)
    route("/api/generate", ollama.generate)
    route("/v1/completions/render", render.render_completion)
    route("/v1/chat/completions/render", render.render_chat)
    route("/tokenize", tokens.tokenize)
    route("/detokenize", tokens.detokenize)

    @app.get("/info")
    async def tgi_info():
        return tgi.info(served, engine.slots + engine.max_waiting)

    @app.get("/api/tags")
    async def ollama_tags():
        return ollama.tags(served)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return tokens.tokenizer_info(served)

    return app

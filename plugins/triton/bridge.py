"""The engine's side of the Triton model: a Unix socket the model's instances (Triton Python backend
stubs, plugins/triton/model.py) hand their requests to, served by our engine through `Served`, as
mqa-serve's routes are.

One connection per request: the stub sends one JSON line, {"inputs": {name: values}, "parameters":
{...}}, and reads JSON lines back: {"text": ...} per engine step when streaming, the last one with
"finish" (and the counts asked for), or one {"error": ..., "code": ...}. A stub that closes its end
(Triton cancelled the request: its client left) cancels the generation, so its KV slot is freed at
the next step. A connection that opens with {"op": "metrics"} asks for the engine's Prometheus
samples, one JSON line per "metrics" line it sends; the first such connection is the one whose stub
mirrors them into Triton's /metrics (the others are told no, so no counter is counted twice).

Everything here runs on one asyncio loop in its own thread; the engine's decode loop keeps the main
thread (as in mqa-serve).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import threading
import time

from plugins.http.api import RequestError
from plugins.http.served import GenerationFailed, Served
from plugins.triton.params import Asked, Invalid, parse

LINE_LIMIT = 64 << 20  # one request line: Triton's own HTTP input limit is 64 MB


def error_code(exc: RequestError) -> str:
    """Triton's error code for one of our request errors (its HTTP status follows from the code)."""
    if exc.status in (429, 503):
        return "UNAVAILABLE"
    return "INTERNAL" if exc.status >= 500 else "INVALID_ARG"


def samples(registry) -> list:
    """[name, kind, help, labels, value] of every sample in a prometheus_client registry; histograms
    as their _bucket, _sum and _count counters."""
    out = []
    for family in registry.collect():
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            kind = "gauge" if family.type == "gauge" else "counter"
            out.append([s.name, kind, family.documentation or family.name, dict(s.labels), s.value])
    return out


class Bridge:
    def __init__(self, served: Served, path: str):
        self.served, self.path = served, path
        self.loop = asyncio.new_event_loop()
        self._server = None
        self._metrics_owner = None
        self._tasks: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.thread = threading.Thread(target=self._run, name="triton-bridge", daemon=True)
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def start(self) -> None:
        self.thread.start()
        self._ready.wait()
        if self._error:
            raise self._error

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self._server = self.loop.run_until_complete(
                asyncio.start_unix_server(self._handle, self.path, limit=LINE_LIMIT))
            os.chmod(self.path, 0o600)  # the stubs run as this user; nobody else hands the engine requests
        except BaseException as e:
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()

    def stop(self) -> None:
        """Close the socket and end every open connection (their stubs answer their requests with an error)."""
        if not self.thread.is_alive():
            return

        async def close():
            self._server.close()
            # cut the connections rather than cancel their handlers: each then ends as when its stub
            # leaves (a cancelled handler task is logged by asyncio's stream protocol)
            for writer in list(self._writers):
                writer.transport.abort()
            if self._tasks:
                await asyncio.wait(list(self._tasks), timeout=5)
            self.loop.stop()

        asyncio.run_coroutine_threadsafe(close(), self.loop)
        self.thread.join(10)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        self._writers.add(writer)
        try:
            line = await reader.readline()
            if not line:
                return
            msg = json.loads(line)
            if msg.get("op") == "metrics":
                await self._metrics(reader, writer)
            else:
                await self._generate(msg, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the stub left
        except (ValueError, TypeError, AttributeError) as e:  # not our stub's JSON (or over LINE_LIMIT)
            with contextlib.suppress(ConnectionError):
                await _send(writer, {"error": f"malformed request: {str(e)[:200]}", "code": "INVALID_ARG"})
        finally:
            self._tasks.discard(task)
            self._writers.discard(writer)
            writer.close()

    async def _metrics(self, reader, writer) -> None:
        if self._metrics_owner is not None:
            await _send(writer, {"owner": False})
            return
        self._metrics_owner = writer
        try:
            await _send(writer, {"owner": True})
            registry = self.served.engine.metrics.registry
            while await reader.readline():
                await _send(writer, {"samples": samples(registry)})
        finally:
            self._metrics_owner = None

    async def _generate(self, msg: dict, reader, writer) -> None:
        arrived = time.monotonic()
        try:
            asked = parse(msg.get("inputs") or {}, msg.get("parameters"))
            gen, prompt = await self._start(asked, arrived)
        except Invalid as e:
            await _send(writer, {"error": str(e), "code": "INVALID_ARG"})
            return
        except RequestError as e:
            await _send(writer, {"error": e.message, "code": error_code(e)})
            return
        # the stub closes its end when Triton cancels the request: stop generating for it
        left = asyncio.ensure_future(reader.read())
        stream = asyncio.ensure_future(self._stream(asked, gen, len(prompt), writer))
        try:
            await asyncio.wait({left, stream}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (left, stream):
                task.cancel()  # a cancelled stream ends its generation (Generation.events cancels it)
            await asyncio.gather(left, stream, return_exceptions=True)

    async def _start(self, asked: Asked, arrived: float):
        served = self.served
        if asked.ignored:
            served.note_ignored(asked.ignored)
        for token in asked.stop_token_ids:
            if token >= served.vocab_size:
                raise Invalid(f"`stop_token_ids` holds {token}: not a token of this model "
                              f"(vocabulary {served.vocab_size})")
        prompt = await served.prompt_ids(asked.text, name="text_input")
        request = served.request(
            prompt=prompt, max_tokens=asked.max_tokens, do_sample=asked.sample,
            temperature=asked.temperature if asked.sample else 1.0, top_k=asked.top_k, top_p=asked.top_p,
            min_p=asked.min_p, seed=asked.seed if asked.seed is not None else secrets.randbits(62),
            eos_token_id=None if asked.ignore_eos else served.eos, repetition_penalty=asked.repetition_penalty,
            presence_penalty=asked.presence_penalty, frequency_penalty=asked.frequency_penalty,
            min_tokens=asked.min_tokens, stop_token_ids=tuple(asked.stop_token_ids))
        [gen] = served.start([request], asked.stop, arrived, skip_special=True)
        return gen, prompt

    async def _stream(self, asked: Asked, gen, prompt_tokens: int, writer) -> None:
        parts = [] if asked.exclude_input_in_output else [asked.text]
        try:
            async for event in gen.events():
                if event.finish is None:
                    if asked.stream and (event.text or parts):
                        await _send(writer, {"text": "".join(parts) + event.text})
                        parts = []
                    elif not asked.stream:
                        parts.append(event.text)
                    continue
                last = {"text": "".join(parts) + event.text, "finish": event.finish}
                if asked.return_finish_reason:
                    last["finish_reason"] = event.finish
                if asked.return_num_input_tokens:
                    last["num_input_tokens"] = prompt_tokens
                if asked.return_num_output_tokens:
                    last["num_output_tokens"] = gen.completion_tokens
                await _send(writer, last)
                return
        except GenerationFailed as exc:
            err = exc.error()
            await _send(writer, {"error": err.message, "code": error_code(err)})


async def _send(writer: asyncio.StreamWriter, obj: dict) -> None:
    writer.write(json.dumps(obj, separators=(",", ":")).encode() + b"\n")
    await writer.drain()

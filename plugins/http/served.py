"""What every endpoint shares: the serving engine, the tokenizer, prompt checks, and one generation as a
stream of events (text as it becomes final, the token ids and log-probabilities behind it).

The event loop tokenizes (in a worker thread), queues requests with the serving engine and turns the
token ids it streams back into text; the engine's loop runs in its own thread.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from dataclasses import dataclass, field

from starlette.concurrency import run_in_threadpool

from plugins.http.api import RequestError, check_token_ids
from plugins.http.text import EOS_NAMES, StreamText, encode_prompt, special_id
from plugins.serving.engine import Arrival, QueueFull, ResultQueue, ServerClosing, ServingEngine
from plugins.serving.request import Request, RequestRefused

MAX_BODY_BYTES = 4 << 20
MAX_IGNORED_NAMES = 256  # unknown field names remembered as already logged


def max_token_bytes(tokenizer) -> int | None:
    """An upper bound on the UTF-8 bytes of text one token stands for: a byte-level BPE token's string
    has one character per byte, and each character is at least one byte in UTF-8. None where a
    normalizer could shrink text before it is split (then no bound holds)."""
    if tokenizer.normalizer is not None:
        return None
    return max((len(t.encode("utf-8")) for t in tokenizer.get_vocab(with_added_tokens=True)), default=1)


class GenerationFailed(Exception):
    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def error(self) -> RequestError:
        closing = self.message.startswith("the server is shutting down")
        return RequestError(self.message, status=503 if closing else 500, kind="server_error")


@dataclass
class Event:
    text: str                          # text now final (maybe "")
    tokens: list[int] = field(default_factory=list)  # token ids fed since the last event
    logprobs: list | None = None       # their (logprob, [(id, logprob)]) where asked
    finish: str | None = None          # "stop" or "length" on the last event
    stopped_by_text: bool = False      # the finish is a stop string's (not a stop token's)


# the Arrival of the request whose task this is (set by Served.arrival, read by Served.start)
_ARRIVAL: contextvars.ContextVar[Arrival] = contextvars.ContextVar("arrival")


class Served:
    """What the app serves: the serving engine (over an open backend), its tokenizer and the model id."""

    def __init__(self, engine: ServingEngine, tokenizer, model_id: str, vocab_size: int,
                 max_body_bytes: int = MAX_BODY_BYTES, chat=None):
        """`chat`: the checkpoint's chat template (plugins.http.chat.ChatTemplate), or None."""
        self.engine, self.tokenizer, self.model_id, self.vocab_size = engine, tokenizer, model_id, vocab_size
        self.chat = chat
        self.eos = special_id(tokenizer, EOS_NAMES)
        self.special_ids = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        self.created = int(time.time())
        self.max_body_bytes = max_body_bytes
        per_token = max_token_bytes(tokenizer)
        # a prompt (+ suffix) of more bytes than this cannot fit the context: refused before tokenizing
        self.max_prompt_bytes = None if per_token is None else per_token * (engine.capacity - 1)
        self._ignored: set[str] = set()

    @property
    def capacity(self) -> int:
        return self.engine.capacity

    def arrival(self) -> Arrival:
        """This request's `Arrival` (the engine's first step of a burst waits for it until `start` queues
        it), kept in the request's task context for `start`."""
        arrival = self.engine.arrival()
        _ARRIVAL.set(arrival)
        return arrival

    def note_ignored(self, names) -> None:
        """Unknown request fields are ignored. A request naming fields not logged before gets one log line
        (its first few names and a count); the names remembered are bounded, so a client sending
        endless new names costs one short line per request and no memory."""
        new = [name for name in dict.fromkeys(names) if name not in self._ignored]
        if not new:
            return
        if len(self._ignored) < MAX_IGNORED_NAMES:
            self._ignored.update(new[:MAX_IGNORED_NAMES - len(self._ignored)])
        shown = ", ".join(repr(name[:40]) for name in new[:5])
        more = f" and {len(new) - 5} more" if len(new) > 5 else ""
        print(f"ignoring request field{'s' if len(new) > 1 else ''} {shown}{more} (not used by this server)",
              flush=True)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_id:
            raise RequestError(f"model {model!r} does not exist; this server serves {self.model_id!r}",
                               "model", status=404, code="model_not_found")

    async def prompt_ids(self, prompt, suffix: str | None = None, name: str = "prompt") -> list[int]:
        """Token ids of a text prompt (fill-in-the-middle with `suffix`) or checked ids as given."""
        if isinstance(prompt, list):  # token ids
            if suffix is not None:
                raise RequestError("`suffix` needs a text prompt, not token ids", "suffix")
            check_token_ids(prompt, self.vocab_size, name)
            if not prompt:
                raise RequestError(f"`{name}` is empty", name)
            return list(prompt)
        self.check_text_bytes(prompt + (suffix or ""), name)
        try:
            ids = await run_in_threadpool(encode_prompt, self.tokenizer, prompt, suffix)
        except ValueError as e:
            raise RequestError(str(e), "suffix") from None
        if not ids:
            raise RequestError(f"`{name}` encodes to no tokens", name)
        return ids

    def check_text_bytes(self, text: str, name: str) -> None:
        """Refuse, before tokenizing, a text of more bytes than the context's tokens can stand for."""
        if self.max_prompt_bytes is not None:
            size = len(text.encode())
            if size > self.max_prompt_bytes:
                raise RequestError(f"`{name}` is {size} bytes: more than {self.capacity - 1} tokens of this "
                                   f"model's context can hold (at most {self.max_prompt_bytes} bytes)", name)

    def check(self, requests: list[Request], names: dict[str, str] | None = None) -> None:
        """What `start` would refuse of these requests, as a RequestError naming the field by this
        route's name for it (`names`: the engine's name -> the route's, e.g. TGI's max_new_tokens)."""
        try:
            for request in requests:
                request.check(self.capacity)
        except RequestRefused as e:
            raise _refused(e, names) from None

    def start(self, requests: list[Request], stop: list[str], arrived: float, skip_special: bool = False,
              include_stop: bool = False, names: dict[str, str] | None = None) -> list["Generation"]:
        """Queue generations together (all or none; RequestError 400 for what the engine refuses, 503
        when the queue is full or the server closes). The text leaves out EOS and the stop token ids;
        with `skip_special`, every special token; it ends before a stop string, or with it (`include_stop`)."""
        loop = asyncio.get_running_loop()
        queues = [ResultQueue(r, loop, arrived=arrived) for r in requests]
        try:
            self.engine.submit(*queues, arrival=_ARRIVAL.get(None))
        except RequestRefused as e:
            raise _refused(e, names) from None
        except (QueueFull, ServerClosing) as e:
            raise RequestError(str(e), status=503, kind="server_error", code="overloaded") from None
        special = self.special_ids if skip_special else set()
        return [Generation(self.engine, q, StreamText(self.tokenizer, stop, skip_ids=(
            {self.eos} | set(q.request.stop_token_ids) | special) - {None}, include_stop=include_stop))
            for q in queues]

    def request(self, **fields) -> Request:
        return Request(id=self.engine.new_id(), **fields)


def _refused(e: RequestRefused, names: dict[str, str] | None) -> RequestError:
    name = (names or {}).get(e.field, e.field)
    return RequestError(e.message(name.rpartition(".")[2]), name)


class Generation:
    """One queued request: its events, and its prompt's log-probabilities once prefilled."""

    def __init__(self, engine: ServingEngine, queue: ResultQueue, text: StreamText):
        self.engine, self.results, self.text = engine, queue, text
        self.prompt_logprobs: list | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.text.ids)

    def cancel(self) -> None:
        self.engine.cancel(self.results.request.id)

    async def events(self):
        """Event per step with new text; the last has `finish`. GenerationFailed on an error. Leaving
        early (client gone, stop string) drops the request from the batch."""
        finished = False
        try:
            while True:
                item = await self.results.queue.get()
                kind = item[0]
                if kind == "prompt":
                    self.prompt_logprobs = item[1]
                elif kind == "tokens":
                    _, tokens, logprobs, reason = item
                    piece = self.text.add(tokens)
                    if self.text.stopped:
                        yield Event(piece, tokens, logprobs, "stop", stopped_by_text=True)
                        return
                    if reason is not None:
                        finished = True
                        yield Event(piece + self.text.flush(), tokens, logprobs, reason)
                        return
                    yield Event(piece, tokens, logprobs)
                elif kind == "done":
                    finished = True
                    yield Event(self.text.flush(), finish="stop" if item[1] == "cancelled" else item[1])
                    return
                else:
                    finished = True
                    raise GenerationFailed(item[1])
        finally:
            if not finished:
                self.cancel()


async def merged(generations: list[Generation]):
    """(index, Event) from several generations as they come; the first failure ends them all."""
    if len(generations) == 1:
        async for event in generations[0].events():
            yield 0, event
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, gen):
        try:
            async for event in gen.events():
                await queue.put((i, event))
        except Exception as exc:
            await queue.put((i, exc))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generations)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for gen in generations:
            gen.cancel()  # a no-op for the finished ones (the engine no longer holds them)

"""Continuous batching on a preallocated KV pool: requests join and leave a running batch at any step.

The pool is `slots` rows x `capacity` columns per layer, allocated once. Active requests occupy
rows [0, n); all of them share one time axis: every decode step writes each row's new token at
column `t`, and a row's tokens sit in columns [start, t) (left padding, masked). So each engine
decodes the batch exactly as it decodes a static left-padded batch: a dense [n, .., t + 1, ..]
cache and a [n, t + 1] mask, no per-row lengths, no gathers.

- Admission: the prompt is prefilled alone (batch 1, its own scratch cache: the numerics of
  `generate` on that request alone), its first token sampled, and its KV copied into row n at
  columns [t - P, t). A prompt longer than `t` shifts the running rows right first. Requests
  admitted with the same prompt (n choices) share one prefill.
- Chunked prefill: with a token budget (`max_batched_tokens`, vLLM's `max_num_batched_tokens`), a
  step computes at most budget - (rows decoding) prompt tokens, first come first served: a long
  prompt spreads over several steps (each chunk attends to the KV of the chunks before it, as a
  prefix-cache hit does), several short ones share a step, and the running rows decode every step.
  A request holds its slot from admission; its first token comes with its last chunk. The chunks run
  as their own forwards before the decode step (our engines attend over a dense cache: one forward
  of decode rows and prompt chunks together would need variable-length attention).
- Sampling: each row's own rules (penalties, bias, min tokens: LogitRules) and sampler; a batch of
  plain greedy rows is one argmax.
- Release: the last active row moves into the freed row, so rows stay packed.
- Failure of one request: an error raised while admitting or sampling for one request (not by the
  engine's forward over the batch) ends that request alone, reported in the step's "failed"; the
  other rows go on.
- Compaction: when column `capacity` is reached (or half of every row is padding) all rows shift
  left by their common padding. Every request fits (prompt + max_new_tokens <= capacity), so the
  common padding is never zero when it is needed.

Slots rather than blocks: every engine here attends over a dense cache tensor (SDPA, megatron's
static context); blocks would need a gather of the whole cache each step or a paged CPU kernel.
With MQA a slot of 2048 tokens of SantaCoder-1B is 25 MB, so dense slots cost little.
"""

from __future__ import annotations

from dataclasses import dataclass

import time

import torch

from plugins.core.config import ConfigError
from plugins.core.tensors import tensor_bytes
from plugins.engine.backend import LocalBackend
from plugins.engine.contract import BatchDecoder
from plugins.engine.sampling import LogitRules, Sampler, top_logprobs
from plugins.serving.prefix_cache import PrefixCache


@dataclass
class BatchRequest:
    """What a slot needs to generate for one request; `id` is the caller's."""

    id: int
    prompt: list[int]
    max_new_tokens: int
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    eos_token_id: int | None = None  # stop at this token (it is returned)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    min_new_tokens: int = 0        # EOS and stop_token_ids cannot come before this many tokens
    stop_token_ids: tuple[int, ...] = ()  # stop at any of these too (returned)
    logprobs: int | None = None    # with each token: its log-probability and this many top alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (one extra forward)

    def rules(self) -> LogitRules:
        stops = set(self.stop_token_ids) | ({self.eos_token_id} - {None})
        return LogitRules(self.repetition_penalty, self.presence_penalty, self.frequency_penalty, self.logit_bias,
                          self.min_new_tokens, stops)


def check_request(request: BatchRequest, capacity: int) -> None:
    """What a KV slot of `capacity` columns can take (checked before a request is admitted)."""
    if not request.prompt:
        raise ConfigError("a request needs at least one prompt token")
    if request.max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
    if not 0 <= request.min_new_tokens <= request.max_new_tokens:
        raise ConfigError(f"min_new_tokens must be in [0, max_new_tokens], got {request.min_new_tokens}")
    if len(request.prompt) + request.max_new_tokens > capacity:
        raise ConfigError(f"prompt ({len(request.prompt)} tokens) + max_new_tokens ({request.max_new_tokens}) "
                          f"exceeds the context of {capacity} tokens")


def _message(exc: BaseException) -> str:
    """One short line for the client whose request failed (no traceback, no internals)."""
    text = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return text if len(text) <= 200 else text[:197] + "..."


@dataclass
class _Row:
    request: BatchRequest
    sampler: Sampler
    rules: LogitRules
    output: list[int]

    @property
    def plain(self) -> bool:
        """Greedy on the raw logits, nothing else asked: the batch's one argmax serves it."""
        return not (self.request.do_sample or self.rules.active or self.request.logprobs is not None)

    def choose(self, logits: torch.Tensor, logprobs: dict) -> int:
        """This row's next token from its logits [1, V]; its log-probabilities (of the raw logits, as
        vLLM reports them) into `logprobs`."""
        token = int(self.sampler(self.rules(logits, self.request.prompt, self.output) if self.rules.active
                                 else logits)[0])
        if self.request.logprobs is not None:
            logprobs.setdefault(self.request.id, []).append(top_logprobs(logits[0], token, self.request.logprobs))
        return token


@dataclass(eq=False)
class _Prefill:
    """A prompt on its way into the pool, chunk by chunk, for the requests that share it."""

    requests: list[BatchRequest]
    done: int = 0                      # prompt columns computed or taken from the prefix cache
    kv: list[torch.Tensor] | None = None  # their K and V (pool layout, `done` columns)
    logits: torch.Tensor | None = None    # of the last computed position
    started: bool = False

    @property
    def prompt(self) -> list[int]:
        return self.requests[0].prompt


class ContinuousBatch:
    """`prefix_cache_bytes` > 0 keeps the KV of prompt prefixes for later prompts that share them
    (plugins.serving.prefix_cache); 0 turns that off. `max_batched_tokens` (None: no limit) bounds the
    tokens of one step, decode rows included: prompts beyond it are prefilled in chunks over steps."""

    def __init__(self, decoder: BatchDecoder, slots: int, capacity: int, device="cpu", prefix_cache_bytes: int = 0,
                 score=None, max_batched_tokens: int | None = None):
        """`score(input_ids, attention_mask)` -> logits of every position: prompt log-probabilities."""
        if slots < 1 or capacity < 2:
            raise ConfigError(f"a KV pool needs >= 1 slot and >= 2 columns, got {slots} x {capacity}")
        self.decoder, self.slots, self.capacity, self.score = decoder, slots, capacity, score
        self.max_batched_tokens = max_batched_tokens
        self.filling: list[_Prefill] = []  # admitted, prompt not all computed yet (FIFO)
        self.prefix = PrefixCache(prefix_cache_bytes, decoder.time_dim) if prefix_cache_bytes > 0 else None
        self.mask = torch.zeros((slots, capacity), dtype=torch.long, device=device)
        self.last = torch.zeros((slots, 1), dtype=torch.long, device=device)
        self.pos = torch.zeros((slots, 1), dtype=torch.long, device=device)
        self.rows: list[_Row] = []
        self.t = 0  # columns in use
        self.prefill_tokens = 0  # prompt tokens computed so far (not those of shared prefills or cache hits)

    @property
    def n(self) -> int:
        return len(self.rows)

    def check(self, request: BatchRequest) -> None:
        check_request(request, self.capacity)

    @property
    def held(self) -> int:
        """Slots taken: running rows and requests whose prompt is being prefilled."""
        return self.n + sum(len(fill.requests) for fill in self.filling)

    @torch.inference_mode()
    def step(self, admit: list[BatchRequest] = (), release: list[int] = ()) -> dict:
        """Drop `release` (ids), take `admit`, prefill what the token budget allows (whole prompts
        without one), place the prompts now complete, then one decode step for every active row.
        Returns {"tokens": {id: [new token ids]}, "finished": {id: "stop" (EOS) or "length"},
        "failed": {id: message}} (requests that raised alone, now released), and where asked
        "logprobs": {id: [(logprob, [(token, logprob) x k]) per new token]}, "prompt_logprobs": {id: the
        same per prompt token after the first}; "prefill_tokens": prompt tokens computed since the
        start; this step's "chunk_tokens" (prompt tokens computed), "prefill_s" and "decode_s"."""
        for request in admit:
            self.check(request)
        if self.held + len(admit) > self.slots:
            raise ConfigError(f"{self.held + len(admit)} requests for {self.slots} slots")
        for rid in release:
            self._release(rid)
        for request in admit:  # n choices of one prompt join one prefill
            fill = next((f for f in self.filling if f.prompt == request.prompt), None)
            if fill is None:
                self.filling.append(_Prefill([request]))
            else:
                fill.requests.append(request)
        out: dict[int, list[int]] = {}
        finished: dict[int, str] = {}
        failed: dict[int, str] = {}
        logprobs: dict[int, list] = {}
        prompt_logprobs: dict[int, list] = {}
        start, chunk_tokens = time.perf_counter(), 0
        budget = float("inf") if self.max_batched_tokens is None else max(self.max_batched_tokens - self.n, 1)
        for fill in list(self.filling):
            if chunk_tokens >= budget:
                break
            try:
                chunk_tokens += self._prefill(fill, budget - chunk_tokens)
            except Exception as exc:  # these requests alone
                self.filling.remove(fill)
                for request in fill.requests:
                    failed[request.id] = _message(exc)
                continue
            if fill.done == len(fill.prompt):
                self.filling.remove(fill)
                for request in fill.requests:
                    n = self.n
                    try:
                        self._place(request, fill, out, finished, logprobs, prompt_logprobs)
                    except Exception as exc:  # this request alone (a row is placed only at the end of _place)
                        del self.rows[n:]
                        for part in (out, finished, logprobs, prompt_logprobs):
                            part.pop(request.id, None)
                        failed[request.id] = _message(exc)
        decode_start = time.perf_counter()
        if self.rows:
            self._decode(out, finished, failed, logprobs)
        result = {"tokens": out, "finished": finished, "failed": failed, "prefill_tokens": self.prefill_tokens,
                  "chunk_tokens": chunk_tokens, "prefill_s": decode_start - start,
                  "decode_s": time.perf_counter() - decode_start}
        if logprobs:
            result["logprobs"] = logprobs
        if prompt_logprobs:
            result["prompt_logprobs"] = prompt_logprobs
        if self.prefix:
            result["prefix_cache"] = self.prefix.stats()
        return result

    def _release(self, rid: int) -> None:
        for r, row in enumerate(self.rows):
            if row.request.id == rid:
                self._remove(r)
                return
        for fill in self.filling:
            fill.requests = [r for r in fill.requests if r.id != rid]
        self.filling = [fill for fill in self.filling if fill.requests]

    def _prefill(self, fill: _Prefill, budget: float) -> int:
        """The next chunk of `fill`'s prompt, at most `budget` tokens; returns the tokens computed."""
        prompt = fill.prompt
        if not fill.started:
            fill.started = True
            fill.done, fill.kv = self.prefix.lookup(prompt) if self.prefix else (0, None)
        end = int(min(len(prompt), fill.done + budget))
        ids = torch.tensor([prompt[:end]], dtype=torch.long, device=self.mask.device)
        fill.logits, fill.kv = self.decoder.prefill_alone(ids, fill.kv if fill.done else None)
        computed, fill.done = end - fill.done, end
        self.prefill_tokens += computed
        if end == len(prompt) and self.prefix:
            self.prefix.insert(prompt, fill.kv)
        return computed

    def _emit(self, row: _Row, token: int, out: dict, finished: dict) -> bool:
        out.setdefault(row.request.id, []).append(token)
        row.output.append(token)
        if token == row.request.eos_token_id or token in row.request.stop_token_ids:
            finished[row.request.id] = "stop"
        elif len(row.output) >= row.request.max_new_tokens:
            finished[row.request.id] = "length"
        return row.request.id in finished

    def _place(self, request: BatchRequest, fill: _Prefill, out: dict, finished: dict, logprobs: dict,
               prompt_logprobs: dict) -> None:
        """Sample the first token from the complete prompt's logits, then copy its KV into a new row."""
        p, r = len(request.prompt), request
        row = _Row(r, Sampler(r.do_sample, r.temperature, r.top_k, r.top_p, r.seed, r.min_p), r.rules(), [])
        if r.prompt_logprobs is not None:
            prompt_logprobs[r.id] = self._prompt_logprobs(r)
        token = row.choose(fill.logits, logprobs)
        if self._emit(row, token, out, finished):
            return
        if p > self.t:
            self._shift(p - self.t)  # (n == 0: nothing moves, t becomes p)
        i = self.n
        for pool, part in zip(self.decoder.pool_tensors(), fill.kv):
            self._cols(self._row(pool, i), self.t - p, self.t).copy_(part)
        self.mask[i].zero_()
        self.mask[i, self.t - p:self.t] = 1
        self.last[i, 0] = token
        self.pos[i, 0] = p
        self.rows.append(row)

    def _prompt_logprobs(self, request: BatchRequest) -> list:
        if self.score is None:
            raise ConfigError("this engine cannot score prompts (no prompt log-probabilities)")
        ids = torch.tensor([request.prompt], dtype=torch.long, device=self.mask.device)
        logits = self.score(ids, torch.ones_like(ids))[0]
        return [top_logprobs(logits[i - 1], token, request.prompt_logprobs)
                for i, token in enumerate(request.prompt) if i > 0]

    def _decode(self, out: dict, finished: dict, failed: dict, logprobs: dict) -> None:
        if self.t == self.capacity:
            self._compact()
        n, t = self.n, self.t
        self.mask[:n, t] = 1
        logits = self.decoder.decode(self.last[:n], self.mask[:n, :t + 1], self.pos[:n])
        self.t += 1
        self.pos[:n] += 1
        if all(row.plain for row in self.rows):
            tokens = logits.float().argmax(-1).tolist()
        else:
            tokens = [self._choose(row, logits[r:r + 1], failed, logprobs) for r, row in enumerate(self.rows)]
        done = []
        for r, (row, token) in enumerate(zip(self.rows, tokens)):
            if token is None:  # its sampling raised: released, reported in `failed`
                done.append(r)
                continue
            self.last[r, 0] = token
            if self._emit(row, token, out, finished):
                done.append(r)
        for r in reversed(done):
            self._remove(r)
        if self.n and self._padding() * 2 >= self.t:
            self._compact()

    @staticmethod
    def _choose(row: _Row, logits: torch.Tensor, failed: dict, logprobs: dict) -> int | None:
        try:
            return row.choose(logits, logprobs)
        except Exception as exc:
            failed[row.request.id] = _message(exc)
            return None

    def _remove(self, r: int) -> None:
        last = self.n - 1
        if r != last:
            for pool in self.decoder.pool_tensors():
                self._cols(self._row(pool, r), 0, self.t).copy_(self._cols(self._row(pool, last), 0, self.t))
            for buf in (self.mask, self.last, self.pos):
                buf[r] = buf[last]
            self.rows[r] = self.rows[last]
        self.rows.pop()
        if not self.rows:
            self.t = 0

    def _padding(self) -> int:
        """Columns before the first token of every active row."""
        n, t = self.n, self.t
        return int(self.mask[:n, :t].argmax(-1).min()) if n else 0

    def _compact(self) -> None:
        self._shift(-self._padding())

    def _shift(self, by: int) -> None:
        """Move the columns of every active row `by` to the right (left when negative)."""
        n, t = self.n, self.t
        if by == 0:
            return
        if n:
            lo = max(0, -by)  # columns [lo, t) move to [lo + by, t + by)
            for pool in self.decoder.pool_tensors() + [self.mask]:
                rows = pool.narrow(self._batch_dim(pool), 0, n)
                src = self._cols(rows, lo, t).clone()
                self._cols(rows, lo + by, t + by).copy_(src)
            if by > 0:
                self.mask[:n, :by] = 0
        self.t = t + by

    def _batch_dim(self, tensor) -> int:
        return 0 if tensor is self.mask else self.decoder.batch_dim

    def _row(self, tensor, i: int) -> torch.Tensor:
        return tensor.narrow(self._batch_dim(tensor), i, 1)

    def _cols(self, tensor, start: int, end: int) -> torch.Tensor:
        dim = 1 if tensor.dim() == 2 else self.decoder.time_dim  # the mask is [rows, columns]
        return tensor.narrow(dim, start, end - start)

    def kv_pool_bytes(self) -> int:
        return tensor_bytes(self.decoder.pool_tensors())

    def state(self) -> dict:
        return {"running": self.n, "prefilling": self.held - self.n, "slots": self.slots, "capacity": self.capacity, "columns": self.t,
                "kv_pool_bytes": self.kv_pool_bytes(),
                "prefix_cache": self.prefix.stats() if self.prefix else None}


def check_batchable(cls) -> None:
    """Refuse, before loading, an engine class that has no continuous batching (no `batch_decoder`
    of its own)."""
    if getattr(cls, "batch_decoder", LocalBackend.batch_decoder) is LocalBackend.batch_decoder:
        raise ConfigError(f"backend {cls.name!r} has no continuous batching")


def open_batch(backend, slots: int, capacity: int | None = None, prefix_cache_bytes: int = 0,
               max_batched_tokens: int | None = None):
    """A continuous batch of `slots` rows on `backend`, its KV pool allocated now: an object with
    `step(admit, release)` and `state()`. `capacity` (prompt + new tokens per request) defaults to
    n_positions; `prefix_cache_bytes` > 0 keeps prompt prefixes' KV for reuse, up to that many bytes
    (per rank); `max_batched_tokens` (None: no limit) is the token budget of a step, over which
    prompts are prefilled in chunks. A backend whose ranks run elsewhere (plugins.dist) opens the
    batch on its ranks."""
    capacity = backend.config.n_positions if capacity is None else capacity
    for name, value, least in (("slots", slots, 1), ("capacity", capacity, 1),
                               ("prefix_cache_bytes", prefix_cache_bytes, 0),
                               ("max_batched_tokens", 1 if max_batched_tokens is None else max_batched_tokens, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(f"{name} must be an integer >= {least}, got {value!r}")
    if capacity > backend.config.n_positions:
        raise ConfigError(f"capacity {capacity} exceeds the model's n_positions {backend.config.n_positions}")
    remote = getattr(type(backend), "open_batch", None)
    if remote is not None:
        return remote(backend, slots, capacity, prefix_cache_bytes, max_batched_tokens)
    return ContinuousBatch(backend.batch_decoder(slots, capacity), slots, capacity, backend.device,
                           prefix_cache_bytes, score=backend.logits, max_batched_tokens=max_batched_tokens)

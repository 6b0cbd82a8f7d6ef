"""The model runner: executes what the scheduler decided for one step (`SchedulerOutput`) on an engine's
KV pool, and answers a `StepResult`. It decides nothing: which requests run, how many prompt tokens
each computes, which prefix-cache entries are kept or dropped, and whether decode rows speculate
come with the step (plugins.serving.scheduler), so every tensor-parallel rank runs the same step.

Active requests hold rows [0, n) of the pool, on one shared time axis (plugins.serving.kv_pool).

- A prompt is prefilled alone (batch 1, its own cache: the numerics of `generate` on that request
  alone), in the chunks the step names: each chunk attends to the K and V of the columns before it,
  which a prefix-cache hit supplies for a first chunk. When the whole prompt is in, its first token is
  sampled and its K and V are copied into a new row; requests admitted with the same prompt (n
  choices) share one prefill. Where the engine can (`BatchDecoder.fuses_chunks`: DeepSpeed's injected
  layers at TP 1), the chunks and the decode step (if any row decodes) are one forward: the linears
  run once over all their tokens, attention runs per sequence. Elsewhere each chunk is its own
  forward first.
- Sampling: each row's own rules (penalties, bias, min tokens: LogitRules) and sampler; a batch of
  plain greedy rows is one argmax.
- Speculative decoding (an engine loaded with `speculative={"draft": ...}`): greedy rows propose by
  prompt lookup or a draft model and a step keeps 1 to k + 1 tokens per row
  (plugins.serving.speculation; a draft model's K and V live in the pool beside the target's:
  plugins.serving.draft).
- Failure of one request: an error raised while prefilling, placing or sampling for one request (not
  by the engine's forward over the batch) ends that request alone, reported in the step's `failed`.

Slots rather than blocks: every engine here attends over a dense cache tensor (SDPA, megatron's
static context); blocks would need a gather of the whole cache each step or a paged CPU kernel.
With MQA a slot of 2048 tokens of SantaCoder-1B is 25 MB, so dense slots cost little.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from plugins.core.config import ConfigError, arch
from plugins.core.tensors import tensor_bytes
from plugins.engine.backend import LocalBackend
from plugins.engine.contract import Backend, BatchDecoder
from plugins.engine.kv_cache import SharedPrefix
from plugins.engine.sampling import top_logprobs
from plugins.serving.draft import DraftedDecoder
from plugins.serving.kv_pool import RowPool
from plugins.serving.request import Request, Row, failure_message
from plugins.serving.speculation import Proposer
from plugins.serving.step import Admission, DecodeReading, RunnerInfo, SchedulerOutput, StepResult


@dataclass(eq=False)
class _Fill:
    """A prompt on its way into the pool, chunk by chunk, for the requests that share it."""

    requests: list[Request]
    done: int = 0                          # prompt columns computed or copied from the prefix cache
    kv: list[torch.Tensor] | None = None   # their K and V (pool layout, `done` columns; None while done == 0)
    logits: torch.Tensor | None = None     # of the last computed position
    scores: torch.Tensor | None = None     # logits of every prompt position, scored once for all its requests
    scored: dict = field(default_factory=dict)  # top-k -> the prompt's log-probabilities

    @property
    def prompt(self) -> list[int]:
        return self.requests[0].prompt


class ModelRunner:
    def __init__(self, decoder: BatchDecoder, slots: int, capacity: int, device="cpu", score=None,
                 proposer: Proposer | None = None, draft_bytes: int = 0):
        """`score(input_ids, attention_mask)` -> logits of every position: prompt log-probabilities."""
        if slots < 1 or capacity < 2:
            raise ConfigError(f"a KV pool needs >= 1 slot and >= 2 columns, got {slots} x {capacity}")
        self.decoder, self.slots, self.capacity, self.score = decoder, slots, capacity, score
        self.pool = RowPool(decoder, slots, capacity, device)
        self.proposer = proposer
        self.fills: dict[int, _Fill] = {}          # fill id -> prompt being prefilled
        self.entries: dict[int, list[torch.Tensor]] = {}  # prefix-cache entry -> its K and V
        self.rows: list[Row] = []                  # row r of the pool serves rows[r]
        pool_bytes = self.pool.nbytes()
        self.info = RunnerInfo(pool_bytes=pool_bytes - draft_bytes, draft_bytes=draft_bytes,
                               token_bytes=(pool_bytes - draft_bytes) // (slots * capacity),
                               speculative=proposer is not None, fuses_chunks=decoder.fuses_chunks)

    @property
    def n(self) -> int:
        return len(self.rows)

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> StepResult:
        result = StepResult()
        for entry in step.evict:
            self.entries.pop(entry, None)
        for rid in step.release:
            self._release(rid)
        for a in step.admit:
            self._admit(a)
        for key, (entry, tokens) in step.reuse.items():
            self._reuse(self.fills[key], entry, tokens)
        for key, (_, columns) in step.share.items():
            self.fills[key].done = columns
        start = time.perf_counter()
        decoding = bool(self.rows)  # rows placed by this step decode from the next one
        keys = [key for key in step.chunks if key in self.fills]
        plan = [(self.fills[key], step.chunks[key]) for key in keys]
        result.prompt_tokens = sum(end - fill.done for fill, end in plan)
        if plan and self.decoder.fuses_chunks and (self.rows or len(plan) > 1):
            # one forward: every row's decode step and the chunks (weights read once)
            chunks = [(self._ids(fill.prompt[:end]), self._prefix(key, fill, keys, step)) for key, (fill, end)
                      in zip(keys, plan)]
            outs = self._decode(result, False, chunks) if self.rows else self._chunks_alone(chunks)
            for (fill, end), (logits, kv) in zip(plan, outs):
                fill.done, fill.logits, fill.kv = end, logits, _own(kv)
            result.seconds["mixed"] = time.perf_counter() - start
            self._place_complete(step, result)
        else:
            for fill, end in plan:
                try:
                    logits, kv = self.decoder.prefill_alone(self._ids(fill.prompt[:end]), fill.kv)
                except Exception as exc:  # these requests alone
                    self._fail_fill(fill, exc, result)
                    continue
                fill.done, fill.logits, fill.kv = end, logits, _own(kv)
            self._place_complete(step, result)
            decode_start = time.perf_counter()
            if plan:
                result.seconds["prefill"] = decode_start - start
            if decoding:
                self._decode(result, step.speculate)
                result.seconds["decode"] = time.perf_counter() - decode_start
        if self.proposer:
            result.speculation = self.proposer.stats()
        return result

    def _admit(self, a: Admission) -> None:
        fill = self.fills.get(a.fill)
        if fill is None:
            self.fills[a.fill] = _Fill([a.request])
        else:  # another choice of a prompt on its way
            fill.requests.append(a.request)

    def _reuse(self, fill: _Fill, entry: int, tokens: int) -> None:
        """A first chunk starts after a cached prefix: views of it, not a copy. The scheduler runs that
        chunk in this same step (the entry pinned for it), and every `prefill_alone` / `mixed` copies the
        prefix into the chunk's own cache and leaves it untouched; the fill then holds that cache."""
        fill.kv = [t.narrow(self.decoder.time_dim, 0, tokens) for t in self.entries[entry]]
        fill.done = tokens

    @staticmethod
    def _prefix(key: int, fill: _Fill, keys: list[int], step: SchedulerOutput):
        """What a chunk starts from: its fill's K and V so far, or the first columns of a chunk ahead of
        it in this forward (`SchedulerOutput.share`)."""
        if key not in step.share:
            return fill.kv
        ahead, columns = step.share[key]
        return SharedPrefix(keys.index(ahead), columns)

    def _release(self, rid: int) -> None:
        for r, row in enumerate(self.rows):
            if row.request.id == rid:
                self._remove(r)
                return
        for key, fill in list(self.fills.items()):
            fill.requests = [r for r in fill.requests if r.id != rid]
            if not fill.requests:
                del self.fills[key]

    def _fail_fill(self, fill: _Fill, exc: Exception, result: StepResult) -> None:
        for key in [k for k, f in self.fills.items() if f is fill]:
            del self.fills[key]
            result.failed_fills.append(key)
        for request in fill.requests:
            result.failed[request.id] = failure_message(exc)

    def _ids(self, tokens: list[int]) -> torch.Tensor:
        return torch.tensor([tokens], dtype=torch.long, device=self.pool.mask.device)

    def _place_complete(self, step: SchedulerOutput, result: StepResult) -> None:
        for key, fill in [(k, f) for k, f in self.fills.items() if f.done == len(f.prompt)]:
            del self.fills[key]
            assert fill.kv is not None and fill.logits is not None  # a whole prompt is computed
            if key in step.keep:
                entry, tokens = step.keep[key]
                self.entries[entry] = [t.narrow(self.decoder.time_dim, 0, tokens).clone(
                    memory_format=torch.contiguous_format) for t in fill.kv]
            for request in fill.requests:
                n = self.n
                try:
                    self._place(request, fill, result)
                except Exception as exc:  # this request alone (a row is placed only at the end of _place)
                    del self.rows[n:]
                    for part in (result.tokens, result.finished, result.logprobs, result.prompt_logprobs):
                        part.pop(request.id, None)
                    result.failed[request.id] = failure_message(exc)

    def _emit(self, row: Row, token: int, result: StepResult) -> bool:
        result.tokens.setdefault(row.request.id, []).append(token)
        reason = row.emit(token)
        if reason is not None:
            result.finished[row.request.id] = reason
        return reason is not None

    def _place(self, request: Request, fill: _Fill, result: StepResult) -> None:
        """Sample the first token from the complete prompt's logits, then copy its KV into a new row."""
        assert fill.kv is not None and fill.logits is not None
        row = Row.of(request)
        if request.prompt_logprobs is not None:
            result.prompt_logprobs[request.id] = self._prompt_logprobs(fill, request.prompt_logprobs)
        token = row.choose(fill.logits, result.logprobs)
        if self._emit(row, token, result):
            return
        self.pool.add(fill.kv, token, request.prompt)
        self.rows.append(row)

    def _prompt_logprobs(self, fill: _Fill, k: int) -> list:
        """The prompt's log-probabilities with top `k`: one scoring forward per prompt, shared by every
        request (n choices) that asks."""
        if self.score is None:
            raise ConfigError("this engine cannot score prompts (no prompt log-probabilities)")
        if fill.scores is None:
            ids = self._ids(fill.prompt)
            fill.scores = self.score(ids, torch.ones_like(ids))[0]
        if k not in fill.scored:
            fill.scored[k] = [top_logprobs(fill.scores[i - 1], token, k)
                              for i, token in enumerate(fill.prompt) if i > 0]
        return fill.scored[k]

    def _decode(self, result: StepResult, speculate: bool, chunks=None) -> list:
        """One decode step of every row; with `chunks`, in one forward with those prompt chunks
        (`BatchDecoder.mixed`), whose (logits, KV) it returns."""
        pool, n, start = self.pool, self.n, time.perf_counter()
        proposer, proposals = self.proposer, None
        if speculate and proposer is not None and not chunks:
            fits = pool.room(proposer.k + 1) - 1
            if fits >= 1:
                proposals = proposer.proposals(self.rows, pool, fits)
        if proposer is not None and proposals is not None:
            made = self._speculate(proposer, proposals, result)
            seconds, proposer.catch_up_s = time.perf_counter() - start - proposer.catch_up_s, 0.0
            result.decode = DecodeReading(n, True, made, seconds)
            return []
        pool.room(1)
        t = pool.t
        pool.mask[:n, t] = 1
        pool.ids[:n, t] = pool.last[:n, 0]
        if chunks:
            logits, chunked = self.decoder.mixed(pool.last[:n], pool.mask[:n, :t + 1], pool.pos[:n], chunks)
        else:
            logits, chunked = self.decoder.decode(pool.last[:n], pool.mask[:n, :t + 1], pool.pos[:n]), []
        pool.t += 1
        pool.pos[:n] += 1
        if all(row.plain for row in self.rows):
            tokens = logits.float().argmax(-1).tolist()
        else:
            tokens = [self._choose(row, logits[r:r + 1], result) for r, row in enumerate(self.rows)]
        self._keep([[token] for token in tokens], result)
        if not chunks:
            result.decode = DecodeReading(n, False, n, time.perf_counter() - start)
        return chunked

    def _chunks_alone(self, chunks) -> list:
        """Prompt chunks in one forward while no row decodes: `mixed` with no rows."""
        pool = self.pool
        return self.decoder.mixed(pool.last[:0], pool.mask[:0, :pool.t + 1], pool.pos[:0], chunks)[1]

    def _speculate(self, proposer: Proposer, proposals: list[list[int]], result: StepResult) -> int:
        """One verify forward of every row's next token and its proposals (padded to the longest); each
        row keeps what the model confirms, the other columns stay masked. Returns the tokens kept."""
        pool, n, t = self.pool, self.n, self.pool.t
        width = max(map(len, proposals)) + 1
        tokens = pool.last[:n].repeat(1, width)
        pool.mask[:n, t:t + width] = 0
        for r, proposal in enumerate(proposals):
            tokens[r, 1:1 + len(proposal)] = torch.tensor(proposal, dtype=torch.long)
            pool.mask[r, t:t + 1 + len(proposal)] = 1
        pool.ids[:n, t:t + width] = tokens
        positions = pool.pos[:n] + torch.arange(width, device=tokens.device)
        logits = self.decoder.verify(tokens, pool.mask[:n, :t + width], positions)  # [n, width, V]
        greedy = logits.float().argmax(-1).tolist()
        kept: list[list[int] | None] = []
        for r, (row, proposal) in enumerate(zip(self.rows, proposals)):
            if row.greedy:
                confirmed = proposer.accept(proposal, greedy[r])
                ends = [j for j, token in enumerate(confirmed) if token in row.rules.stop_ids]
                confirmed = confirmed[:ends[0] + 1] if ends else confirmed  # nothing after a stop token
                kept.append(confirmed)
                if row.request.logprobs is not None:
                    result.logprobs.setdefault(row.request.id, []).extend(
                        top_logprobs(logits[r, j], token, row.request.logprobs) for j, token in enumerate(confirmed))
            else:
                token = self._choose(row, logits[r, :1], result)
                kept.append(None if token is None else [token])
            # this row's columns: its last token and the accepted proposals; the rest masked
            accepted = 0 if kept[-1] is None else len(kept[-1]) - 1
            pool.mask[r, t + 1 + accepted:t + width] = 0
            pool.pos[r] += accepted + 1
        pool.t += width
        pool.holes = True
        proposer.steps += 1
        self._keep(kept, result)
        return sum(len(k) for k in kept if k)

    def _keep(self, kept: list[list[int] | None], result: StepResult) -> None:
        """Each row's new tokens (None: its sampling raised, it is in `failed`), in order until it
        finishes; finished rows leave."""
        done = []
        for r, (row, tokens) in enumerate(zip(self.rows, kept)):
            if tokens is None:
                done.append(r)
                continue
            self.pool.last[r, 0] = tokens[-1]
            if any(self._emit(row, token, result) for token in tokens):
                done.append(r)
        for r in reversed(done):
            self._remove(r)
        self.pool.tidy()

    @staticmethod
    def _choose(row: Row, logits: torch.Tensor, result: StepResult) -> int | None:
        try:
            return row.choose(logits, result.logprobs)
        except Exception as exc:
            result.failed[row.request.id] = failure_message(exc)
            return None

    def _remove(self, r: int) -> None:
        self.pool.remove(r)
        self.rows[r] = self.rows[-1]
        self.rows.pop()

    def kv_tensors(self) -> list[torch.Tensor]:
        """Every KV tensor alive: the pool's (a draft's included), the prefix entries' and the fills'."""
        return (self.decoder.pool_tensors() + [t for kv in self.entries.values() for t in kv]
                + [t for fill in self.fills.values() if fill.kv for t in fill.kv])

    def kv_bytes(self) -> int:
        """Bytes of the storage behind every KV tensor alive (a view counts its whole storage, once)."""
        storages = {}
        for t in self.kv_tensors():
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())


def _own(kv: list[torch.Tensor]) -> list[torch.Tensor]:
    """K and V that hold their own storage: an engine's prefill may hand views into a larger tensor
    (HF's cache keeps slices of the fused QKV projection), which would keep all of it alive."""
    return [t if t.untyped_storage().nbytes() == t.nbytes else t.clone() for t in kv]


def check_batchable(cls) -> None:
    """Refuse, before loading, an engine class that has no continuous batching (no `batch_decoder`
    of its own)."""
    if getattr(cls, "batch_decoder", LocalBackend.batch_decoder) is LocalBackend.batch_decoder:
        raise ConfigError(f"backend {cls.name!r} has no continuous batching")


def open_runner(backend: Backend, slots: int, capacity: int):
    """A model runner of `slots` rows of `capacity` tokens on `backend`, its KV pool allocated now
    (`execute(SchedulerOutput) -> StepResult`, `info`). A backend whose ranks run elsewhere
    (plugins.launch) opens one on each rank."""
    for name, value, least in (("slots", slots, 1), ("capacity", capacity, 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(f"{name} must be an integer >= {least}, got {value!r}")
    if capacity > arch(backend.config).n_positions:
        raise ConfigError(f"capacity {capacity} exceeds the model's n_positions {arch(backend.config).n_positions}")
    if backend.runs_elsewhere:
        return backend.open_runner(slots, capacity)
    decoder = backend.batch_decoder(slots, capacity)  # refuses what it cannot batch
    proposer, draft_bytes = None, 0
    spec = backend.speculative
    if spec:
        draft = None
        if backend.draft is not None:
            if capacity > arch(backend.draft.config).n_positions:
                raise ConfigError(f"capacity {capacity} exceeds the draft model's n_positions "
                                  f"{arch(backend.draft.config).n_positions}")
            draft = backend.draft.batch_decoder(slots, capacity)
            decoder = DraftedDecoder(decoder, draft)
            draft_bytes = tensor_bytes(draft.pool_tensors())
        proposer = Proposer(spec["k"], spec.get("ngram", 2), draft=draft)
    return ModelRunner(decoder, slots, capacity, backend.device, score=backend.logits, proposer=proposer,
                       draft_bytes=draft_bytes)

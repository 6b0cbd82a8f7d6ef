"""Driving the engine core (plugins.serving.engine.EngineCore: scheduler, KV manager, model runner) step by
step as the server does, and the request schedules the batching and prefix-cache tests share, in process
and across TP ranks."""

import torch

from plugins.core.tokenizer import prompt_token_ids
from plugins.serving.engine import EngineCore
from plugins.serving.request import Request

# (arrival step, prompt length, new tokens, sampling seed or None for greedy)
SCHEDULE = [(0, 9, 12, None), (0, 23, 5, None), (1, 4, 30, None), (2, 31, 9, 7), (2, 6, 1, None),
            (3, 14, 20, None), (5, 40, 8, None), (6, 3, 25, 11), (9, 18, 16, None), (12, 27, 6, None)]
SLOTS = 4
CAPACITY = 64  # small: rows hit the last column and compact several times


def requests(tokenizer, eos=None):
    out = []
    for i, (step, length, new, seed) in enumerate(SCHEDULE):
        out.append((step, Request(id=100 + i, prompt=prompt_token_ids(tokenizer, length, i), max_tokens=new,
                                  do_sample=seed is not None, temperature=0.8, top_p=0.9, seed=seed or 0,
                                  eos_token_id=eos)))
    return out


class Sizes:
    """A token-budget strategy that hands each step the prompt tokens `size(step)` says."""

    def __init__(self, size):
        self.size, self.step = size, 0

    def next(self, rows, pending, now):
        self.step += 1
        return self.size(self.step - 1)

    def observe(self, result):
        pass


def run(backend, schedule, slots=SLOTS, capacity=CAPACITY, cancel=None, budget=None, prefix_cache_bytes=0,
        steps=None, chunk=None, check=None):
    """Requests arrive at their step; the engine core admits them as slots free up. `steps`: a list that
    gets (rows decoding before the step, prompt tokens computed in it, its phases, speculation counts)
    per step. `chunk(step)`: that step's prompt tokens (as the server's adaptive budget hands them).
    `check(core)` runs after every step. Returns ({"kv_pool_bytes"}, tokens per request, finish reasons)."""
    core = EngineCore(backend, slots, capacity, prefix_cache_bytes, max_batched_tokens=budget,
                      budget=Sizes(chunk) if chunk else None)
    waiting, out, finished, failed = list(schedule), {}, {}, set()
    step = 0
    while waiting or core.scheduler.has_work():
        while waiting and waiting[0][0] <= step:
            core.add(waiting.pop(0)[1])
        for rid in list(core.scheduler.running):
            if cancel and cancel(rid, len(out.get(rid, []))):
                core.scheduler.abort(rid)
        decoding = len(core.scheduler.running)
        result = core.step()
        if steps is not None:
            steps.append((decoding, result.prompt_tokens, set(result.seconds), result.speculation))
        for rid, tokens in result.tokens.items():
            out.setdefault(rid, []).extend(tokens)
        finished.update(result.finished)
        failed.update(result.failed)
        # admitted and still without a first token: what the adaptive budget weighs against decoding rows
        admitted = {r for f in core.scheduler.fills.values() for r in f.requests}
        assert core.scheduler.prefilling == len({r for r in admitted if not out.get(r) and r not in failed})
        if check:
            check(core)
        step += 1
    return {"kv_pool_bytes": core.kv.info.pool_bytes + core.kv.info.draft_bytes}, out, finished


def alone(backend, request: Request) -> list[int]:
    ids = torch.tensor([request.prompt])
    result = backend.generate(ids, torch.ones_like(ids), request.max_tokens, do_sample=request.do_sample,
                              temperature=request.temperature, top_p=request.top_p, seed=request.seed)
    return result.tokens[0, len(request.prompt):].tolist()


def shared_requests(tokenizer, fim=False):
    """Prompts sharing 0 %, part and all of a 70-token prefix, arriving together and one by one."""
    base = prompt_token_ids(tokenizer, 70, 3)
    tails = [prompt_token_ids(tokenizer, n, 10 + n) for n in (5, 9, 17)]
    prompts = [base, base[:40] + tails[0], base + tails[1], base, prompt_token_ids(tokenizer, 33, 50),
               base[:20] + tails[2], base + tails[1] + tails[0]]
    if fim:  # the FIM format: <fim-prefix> shared prefix <fim-suffix> suffix <fim-middle>
        prompts = [[1] + p + [3] + t + [2] for p, t in zip(prompts, tails * 3)]
    return [(i // 2, Request(id=i, prompt=p, max_tokens=6 + i)) for i, p in enumerate(prompts)]


def run_with_prefix_cache(backend, schedule, prefix_cache_bytes, slots=3, capacity=160):
    stats = {}
    _, out, _ = run(backend, schedule, slots, capacity, prefix_cache_bytes=prefix_cache_bytes,
                    check=lambda core: stats.update(core.kv.prefix_stats()))
    return out, stats

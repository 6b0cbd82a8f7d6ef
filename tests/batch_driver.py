"""Driving plugins.serving.batching as the server does (FIFO admission while slots are free), and the
request schedules the batching and prefix-cache tests share, in process and across TP ranks."""

import torch

from plugins.core.tokenizer import prompt_token_ids
from plugins.serving.batching import open_batch
from plugins.serving.request import BatchRequest

# (arrival step, prompt length, new tokens, sampling seed or None for greedy)
SCHEDULE = [(0, 9, 12, None), (0, 23, 5, None), (1, 4, 30, None), (2, 31, 9, 7), (2, 6, 1, None),
            (3, 14, 20, None), (5, 40, 8, None), (6, 3, 25, 11), (9, 18, 16, None), (12, 27, 6, None)]
SLOTS = 4
CAPACITY = 64  # small: rows hit the last column and compact several times


def requests(tokenizer, eos=None):
    out = []
    for i, (step, length, new, seed) in enumerate(SCHEDULE):
        out.append((step, BatchRequest(id=100 + i, prompt=prompt_token_ids(tokenizer, length, i), max_new_tokens=new,
                                       do_sample=seed is not None, temperature=0.8, top_p=0.9, seed=seed or 0,
                                       eos_token_id=eos)))
    return out


def run(backend, schedule, slots=SLOTS, capacity=CAPACITY, cancel=None, budget=None, prefix_cache_bytes=0,
        steps=None, chunk=None, check=None):
    """Drive open_batch / step as the server does: FIFO admission while slots are free. `steps`: a list
    that gets (rows decoding before the step, prompt tokens computed in it, its phases, speculation
    counts) per step. `chunk(step)`: that step's prompt tokens (as the server's adaptive budget hands them).
    `check(batch)` runs after every step."""
    batch = open_batch(backend, slots, capacity, prefix_cache_bytes, max_batched_tokens=budget)
    state = batch.state()
    waiting, running, out, finished = list(schedule), set(), {}, {}
    step = 0
    while waiting or running:
        decoding = batch.state()["running"]
        admit = []
        while waiting and waiting[0][0] <= step and len(running) + len(admit) < slots:
            admit.append(waiting.pop(0)[1])
        release = [rid for rid in running if cancel and cancel(rid, len(out.get(rid, [])))]
        running.difference_update(release)
        result = batch.step(admit, release, *([chunk(step)] if chunk else []))
        if steps is not None:
            steps.append((decoding, result["chunk_tokens"], set(result["step_s"]), result.get("speculative")))
        running.update(r.id for r in admit)
        for rid, tokens in result["tokens"].items():
            out.setdefault(rid, []).extend(tokens)
        finished.update(result["finished"])
        running.difference_update(result["finished"])
        # admitted and still without a first token: what the adaptive budget weighs against decoding rows
        assert result["prefilling"] == sum(1 for rid in running if not out.get(rid) and rid not in result["failed"])
        if check:
            check(batch)
        step += 1
    return state, out, finished


def alone(backend, request: BatchRequest) -> list[int]:
    ids = torch.tensor([request.prompt])
    result = backend.generate(ids, torch.ones_like(ids), request.max_new_tokens, do_sample=request.do_sample,
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
    return [(i // 2, BatchRequest(id=i, prompt=p, max_new_tokens=6 + i)) for i, p in enumerate(prompts)]


def run_with_prefix_cache(backend, schedule, prefix_cache_bytes, slots=3, capacity=160):
    batch = open_batch(backend, slots, capacity, prefix_cache_bytes)
    waiting, running, out, step, stats = list(schedule), set(), {}, 0, None
    while waiting or running:
        admit = []
        while waiting and waiting[0][0] <= step and len(running) + len(admit) < slots:
            admit.append(waiting.pop(0)[1])
        result = batch.step(admit)
        running.update(r.id for r in admit)
        for rid, tokens in result["tokens"].items():
            out.setdefault(rid, []).extend(tokens)
        running.difference_update(result["finished"])
        stats = result.get("prefix_cache", stats)
        step += 1
    return out, stats

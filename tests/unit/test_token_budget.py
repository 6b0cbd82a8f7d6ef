"""The adaptive token budget against step times that follow the cost model it assumes (a decode step,
plus a fixed and a per-token cost for a chunk), with the spread seen on these CPUs: it settles on the
largest chunk whose step stays within `stretch` x a decode step, and one noisy reading does not open a
long stall."""

import pytest

from plugins.serving.step import StepResult
from plugins.serving.token_budget import AdaptiveTokenBudget, FixedTokenBudget, WholePrompts


class Driven:
    """The budget as the scheduler drives it: the rows decoding and the requests waiting for a first
    token after one step are what the next step's `next` is told."""

    def __init__(self, budget):
        self.budget, self.rows, self.prefilling = budget, 0, 0

    def next(self, arriving=0):
        return self.budget.next(self.rows, self.prefilling + arriving)

    def observe(self, result: dict):
        self.budget.observe(StepResult(prompt_tokens=result["chunk_tokens"], seconds=result["step_s"]))
        self.rows, self.prefilling = result.get("running", 0), result.get("prefilling", 0)

    def __getattr__(self, name):
        return getattr(self.budget, name)

# (decode step s, chunk fixed s, chunk s per token, fused): an AMX Xeon and an AVX2 EPYC on santacoder-1b
# bf16, the chunk in the decode step's forward (deepspeed) or in its own (hf, megatron, TP 2)
MACHINES = {"amx": (0.12, 0.0, 0.0013, True), "avx2": (0.64, 0.0, 0.038, True)}


def step(decode_s, fixed_s, token_s, fused, chunk, running=8):
    if not chunk:
        return {"step_s": {"decode": decode_s}, "chunk_tokens": 0, "running": running}
    prefill = fixed_s + token_s * chunk
    phases = {"mixed": decode_s + prefill} if fused else {"prefill": prefill, "decode": decode_s}
    return {"step_s": phases, "chunk_tokens": chunk, "running": running}


@pytest.mark.parametrize("machine", MACHINES)
def test_settles_on_the_largest_chunk_within_the_stretch(machine):
    decode_s, fixed_s, token_s, fused = MACHINES[machine]  # chunks in the decode step's forward
    budget = Driven(AdaptiveTokenBudget(first=128, least=8, most=2048, stretch=1.75))
    budget.observe(step(decode_s, fixed_s, token_s, fused, 0))  # rows just placed: not a reading
    assert budget.next() == 0  # a plain decode step: its time is the allowance's unit
    budget.observe(step(decode_s, fixed_s, token_s, fused, 0))
    sizes = []
    for _ in range(30):
        tokens = budget.next()
        sizes.append(tokens)
        budget.observe(step(decode_s, fixed_s, token_s, fused, tokens))
    best = max(int((0.75 * decode_s - fixed_s) / token_s), 8)
    assert sizes[0] == 128
    assert abs(sizes[-1] - best) <= max(2, best // 20), sizes
    step_s = decode_s + fixed_s + token_s * sizes[-1]
    assert step_s <= 1.8 * decode_s or sizes[-1] == 8, (step_s, decode_s)


def test_without_decoding_rows_a_step_takes_the_most_and_a_short_tail_is_not_measured():
    budget = Driven(AdaptiveTokenBudget(first=64, least=8, most=512))
    assert budget.next() == 512  # nothing decodes yet: nobody to stall
    budget.observe(step(0.1, 0, 0.001, True, 0))
    assert budget.next() == 0  # the rows just placed decode: one step without chunks measures the decode step
    budget.observe(step(0.1, 0, 0.001, True, 0))
    assert budget.next() == 64  # rows decode, the chunk cost is not known yet
    budget.observe(step(0.1, 0, 0.001, True, 64))
    assert budget.next() == 75  # 0.075 s allowed / 0.001 s per token
    budget.observe(step(0.1, 0, 0.0, True, 3))  # a prompt's 3-token tail took no time: not a reading
    assert budget.next() == 75
    budget.observe(step(0.1, 0, 0.001, True, 0, running=0))  # every row finished
    assert budget.next() == 512


@pytest.mark.parametrize("machine", MACHINES)
def test_with_prompts_waiting_at_every_step_it_measures_a_plain_decode_step_once(machine):
    """Requests that keep arriving leave a chunk for every step: the decode step is then never seen
    on its own unless the budget asks for one, and without it the budget would stay at `first`."""
    decode_s, fixed_s, token_s, fused = MACHINES[machine]
    budget = Driven(AdaptiveTokenBudget(first=16, least=8, most=2048, stretch=1.75))
    budget.observe({"step_s": {"prefill": 4.0, "decode": decode_s}, "chunk_tokens": 128, "running": 1})
    sizes = []
    for _ in range(30):
        tokens = budget.next()
        sizes.append(tokens)
        budget.observe(step(decode_s, fixed_s, token_s, fused, tokens))  # a prompt is always waiting
    best = max(int((0.75 * decode_s - fixed_s) / token_s), 8)
    assert sizes[:2] == [0, 16] and 0 not in sizes[2:], sizes
    assert abs(sizes[-1] - best) <= max(2, best // 20), sizes


def test_a_chunk_that_looks_free_at_most_doubles_the_budget():
    budget = Driven(AdaptiveTokenBudget(first=64, least=8, most=2048))
    budget.observe(step(0.1, 0, 0.001, True, 0))
    assert budget.next() == 0
    budget.observe(step(0.1, 0, 0.001, True, 0))
    assert budget.next() == 64
    budget.observe({"step_s": {"mixed": 0.1}, "chunk_tokens": 64, "running": 8})  # noise: no time beyond decode
    assert budget.next() == 128
    budget.observe(step(0.1, 0, 0.001, True, 128))  # the true cost again
    assert budget.next() == 147  # 0.075 s / the average of the two readings (0.0005 s per token)


def test_chunks_in_forwards_of_their_own_keep_a_fixed_budget():
    """A chunk's own forward reads every weight (about a decode step): no chunk fits the allowance, so
    the budget does not shrink to nothing and starve the waiting prompts."""
    budget = Driven(AdaptiveTokenBudget(first=16, least=8, own_forward_tokens=128))
    budget.observe({"step_s": {"prefill": 1.0, "decode": 0.2}, "chunk_tokens": 512, "running": 8})
    assert budget.next() == 0  # prompts prefilled while nothing decoded, then placed: not a reading
    budget.observe(step(0.12, 0, 0, False, 0))
    assert budget.next() == 16  # not known yet
    budget.observe(step(0.12, 0.1, 0.0013, False, 16))
    for _ in range(5):
        tokens = budget.next()
        assert tokens == 128
        budget.observe(step(0.12, 0.1, 0.0013, False, tokens))


def test_more_requests_waiting_for_a_first_token_than_rows_decoding_take_the_step():
    """A burst whose first request started a step alone: the other requests arrive during it, and the
    next step prefills them all rather than feeding them a stretch-sized chunk each step behind one
    decoding row. Fewer waiting than decoding: the stretch again, its readings not disturbed."""
    budget = Driven(AdaptiveTokenBudget(first=64, least=8, most=2048))
    assert budget.next(arriving=1) == 2048  # nothing decodes
    budget.observe({"step_s": {"prefill": 1.0}, "chunk_tokens": 128, "running": 1})
    assert budget.next(arriving=15) == 2048  # 15 wait for a first token, 1 row decodes
    budget.observe({"step_s": {"mixed": 16.0}, "chunk_tokens": 1920, "running": 16})
    assert budget.decode_s is None and budget.token_s is None  # that step's time is no reading
    assert budget.next() == 0  # 16 decode, none waits: measure a plain decode step
    budget.observe(step(0.1, 0, 0.001, True, 0, running=16))
    assert budget.next(arriving=1) == 64  # 1 arrives while 16 decode
    budget.observe({**step(0.1, 0, 0.001, True, 64, running=16), "prefilling": 1})  # a long prompt, partly done
    assert budget.next() == 75  # still 1 waiting against 16 decoding: the stretch
    budget.observe({**step(0.1, 0, 0.001, True, 75, running=2), "prefilling": 1})  # 14 rows finished
    assert budget.next(arriving=2) == 2048  # 3 waiting against 2 decoding


def test_refuses_bounds_out_of_order():
    with pytest.raises(ValueError, match="least <= first <= most"):
        AdaptiveTokenBudget(first=4, least=8)
    with pytest.raises(ValueError, match="own_forward_tokens <= most"):
        AdaptiveTokenBudget(most=64)


def test_whole_prompts_and_a_fixed_budget():
    assert WholePrompts().next(rows=5, first_pending=3) == float("inf")
    fixed = FixedTokenBudget(12)
    assert fixed.next(rows=4, first_pending=1) == 8 and fixed.next(rows=30, first_pending=1) == 1

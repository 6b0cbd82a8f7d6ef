"""The goodput token budget against step times that follow the cost model it assumes (a decode step, a
chunk's fixed cost, a cost per prompt token), with the spread seen on these CPUs: it settles on the
largest of the chunk that keeps prefill efficient and the one the streams' latency target allows, gives
prompts the step when a first token would come too late, and one short tail does not skew it."""

import math

import pytest

from plugins.serving.step import StepResult
from plugins.serving.token_budget import FixedTokenBudget, GoodputBudget, WholePrompts, token_budget

# (decode step s, seconds per prompt token, fused): santacoder-1b bf16 at 8 rows on an AMX Xeon and an
# AVX2 EPYC, the chunks in the decode step's forward (deepspeed) or in forwards of their own (hf, megatron)
MACHINES = {"amx": (0.12, 0.0013, True), "avx2": (0.64, 0.038, True), "own-forward": (0.12, 0.0013, False)}
NOW = 1000.0


def step(decode_s, token_s, fused, chunk) -> StepResult:
    if not chunk:
        return StepResult(seconds={"decode": decode_s})
    prefill = token_s * chunk + (0 if fused else decode_s)  # a forward of its own reads every weight too
    phases = {"mixed": decode_s + prefill} if fused else {"prefill": prefill, "decode": decode_s}
    return StepResult(prompt_tokens=chunk, seconds=phases)


def young(tokens=4096):
    """Prompts that arrived just now: no first token at risk."""
    return [(NOW, tokens)]


@pytest.mark.parametrize("machine", MACHINES)
@pytest.mark.parametrize("itl_slo", [0.3, 2.0])
def test_settles_on_the_efficient_or_the_latency_chunk_whichever_is_larger(machine, itl_slo):
    decode_s, token_s, fused = MACHINES[machine]
    budget = GoodputBudget(ttft_slo=1e6, itl_slo=itl_slo, first=64, most=4096)
    assert budget.next(0, young(), NOW) == 4096  # nothing decodes: nobody to stall
    budget.observe(step(decode_s, token_s, fused, 4096))
    assert budget.next(8, young(), NOW) == 0  # rows decode: one plain step measures the decode step
    budget.observe(step(decode_s, token_s, fused, 0))
    assert budget.next(8, young(), NOW) == 64  # the cost per token is not known yet
    for _ in range(20):
        budget.observe(step(decode_s, token_s, fused, budget.tokens))
        budget.next(8, young(), NOW)
    fixed = decode_s * (1 if fused else 2)
    efficient, latency = 4 * fixed / token_s, (itl_slo - fixed) / token_s
    expected = min(max(efficient, latency), 4096)
    assert abs(budget.tokens - expected) <= max(2, expected / 50), (budget.tokens, efficient, latency)
    # prompt tokens/s while prefilling, against a prefill alone (1 / token_s): at least 80 %
    assert budget.tokens / (fixed + budget.tokens * token_s) >= 0.8 / token_s * 0.99


def test_prompts_get_the_step_when_a_first_token_would_be_late():
    decode_s, token_s, _ = MACHINES["amx"]
    budget = GoodputBudget(ttft_slo=2.0, itl_slo=0.3)
    budget.decode_s, budget.token_s = decode_s, token_s
    relaxed = budget.next(8, [(NOW - 0.1, 300)], NOW)
    assert relaxed == int(4 * decode_s / token_s)  # plenty of time: the efficient chunk
    # 350 tokens up to a prompt with 0.5 s left: C >= R * D / (slack - R * tau)
    urgent = budget.next(8, [(NOW - 1.0, 200), (NOW - 1.5, 150)], NOW)
    assert urgent == int(350 * decode_s / (0.5 - 350 * token_s)) > relaxed
    assert budget.next(8, [(NOW - 1.9, 300)], NOW) == 2048  # past saving: everything the step allows


def test_a_short_tail_is_not_a_reading_and_the_last_chunk_of_a_burst_is_not_either():
    budget = GoodputBudget(first=64)
    budget.decode_s = 0.1
    budget.next(8, young(), NOW)
    budget.observe(step(0.1, 0.001, True, 64))
    assert budget.token_s == pytest.approx(0.001)
    budget.next(8, young(), NOW)
    budget.observe(StepResult(prompt_tokens=3, seconds={"mixed": 0.2}))  # 3 tokens took 0.1 s: overheads
    assert budget.token_s == pytest.approx(0.001)


def test_a_step_of_prompts_alone_gives_the_first_reading_of_the_cost_per_token():
    # a burst: its first prompts are computed while nothing decodes, the rest arrive meanwhile
    decode_s, token_s, _ = MACHINES["amx"]
    budget = GoodputBudget(ttft_slo=2.0, itl_slo=0.5, first=256)
    budget.decode_s = decode_s  # measured on an earlier request
    assert budget.next(0, young(384), NOW) == 2048
    budget.observe(StepResult(prompt_tokens=384, seconds={"mixed": decode_s + 384 * token_s}))
    assert budget.token_s == pytest.approx(token_s)
    # 13 prompts of 128 waited a second behind the 3 now decoding: past saving at `first` tokens a step
    assert budget.next(3, [(NOW - 1.0, 128)] * 13, NOW) == 2048
    budget.observe(step(decode_s, 2 * token_s, True, 2048))  # readings with rows are averaged in
    assert budget.token_s == pytest.approx(1.5 * token_s)


def test_whole_prompts_a_fixed_budget_and_the_flag_values():
    assert WholePrompts().next(5, young(), NOW) == math.inf
    fixed = FixedTokenBudget(12)
    assert fixed.next(4, young(), NOW) == 8 and fixed.next(30, young(), NOW) == 1
    assert isinstance(token_budget("auto"), GoodputBudget) and isinstance(token_budget(None), WholePrompts)
    assert token_budget(64).tokens == 64
    with pytest.raises(ValueError, match="count, None or 'auto'"):
        token_budget("fast")


def test_refuses_targets_out_of_range():
    with pytest.raises(ValueError, match="ttft_slo > 0"):
        GoodputBudget(ttft_slo=0)
    with pytest.raises(ValueError, match="first <= most"):
        GoodputBudget(first=4096, most=2048)

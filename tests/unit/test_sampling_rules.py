"""What a request may ask of the logits in the continuous batch (penalties, bias, min_tokens, stop
ids, log-probabilities), checked against HF's own logits processors and log-softmax (fp32)."""

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from plugins.core.tokenizer import prompt_token_ids
from plugins.engine.registry import load_backend
from plugins.engine.sampling import LogitRules, Sampler
from plugins.serving.engine import EngineCore
from plugins.serving.request import Request


@pytest.fixture(scope="module")
def hf(ckpt):
    return load_backend("hf", ckpt, dtype="float32")


@pytest.fixture(scope="module", params=["hf", "deepspeed", "megatron"])
def engine(request, ckpt):
    return load_backend(request.param, ckpt, dtype="float32")


def run_alone(backend, request: Request, slots=4):
    core = EngineCore(backend, slots, 128)
    core.add(request)
    tokens, logprobs = [], []
    while True:
        result = core.step()
        tokens += result.tokens.get(request.id, [])
        logprobs += result.logprobs.get(request.id, [])
        if request.id in result.finished:
            return tokens, logprobs, result.finished[request.id]


def reference(backend, prompt, new, adjust):
    """Greedy by full forwards of the HF model, `adjust(logits [1, V], output)` applied each step."""
    ids = list(prompt)
    for _ in range(new):
        t = torch.tensor([ids])
        logits = backend.logits(t, torch.ones_like(t))[:, -1]
        ids.append(int(adjust(logits, ids[len(prompt):]).argmax(-1)))
    return ids[len(prompt):]


def test_repetition_penalty_is_hfs_processor(engine, hf, tokenizer):
    prompt = prompt_token_ids(tokenizer, 12, 3)
    hf_rule = RepetitionPenaltyLogitsProcessor(1.7)

    def adjust(logits, output):
        return hf_rule(torch.tensor([prompt + output]), logits.clone())

    expected = reference(hf, prompt, 10, adjust)
    got, _, _ = run_alone(engine, Request(id=1, prompt=prompt, max_tokens=10, repetition_penalty=1.7))
    assert got == expected
    assert got != reference(hf, prompt, 10, lambda logits, _: logits)  # the penalty changed something


def test_frequency_and_presence_penalties_are_openais(hf, tokenizer):
    prompt = prompt_token_ids(tokenizer, 9, 5)

    def adjust(logits, output):  # OpenAI: logit - count * frequency - (count > 0) * presence
        logits = logits.clone()
        for token in set(output):
            logits[0, token] -= output.count(token) * 0.9 + 0.6
        return logits

    got, _, _ = run_alone(hf, Request(id=2, prompt=prompt, max_tokens=12, frequency_penalty=0.9,
                                           presence_penalty=0.6))
    assert got == reference(hf, prompt, 12, adjust)
    assert got != reference(hf, prompt, 12, lambda logits, _: logits)


def test_logit_bias_min_tokens_and_stop_ids(hf, tokenizer):
    prompt = prompt_token_ids(tokenizer, 7, 1)
    eos, other = 0, 1000
    pushed = {eos: 100.0}
    # EOS made certain: it comes first and ends the request ...
    tokens, _, reason = run_alone(hf, Request(id=3, prompt=prompt, max_tokens=8, eos_token_id=eos,
                                                   logit_bias=pushed))
    assert (tokens, reason) == ([eos], "stop")
    # ... unless min_new_tokens holds it back (then the same rule as without the bias picks the others)
    tokens, _, reason = run_alone(hf, Request(id=4, prompt=prompt, max_tokens=8, eos_token_id=eos,
                                                   logit_bias=pushed, min_tokens=3))
    assert len(tokens) == 4 and tokens[-1] == eos and eos not in tokens[:3] and reason == "stop"
    assert tokens[:3] == reference(hf, prompt, 3, lambda logits, _: logits.index_fill(1, torch.tensor([eos]),
                                                                                      float("-inf")))
    # a stop token id ends it like EOS
    tokens, _, reason = run_alone(hf, Request(id=5, prompt=prompt, max_tokens=8, stop_token_ids=(other,),
                                                   logit_bias={other: 100.0}))
    assert (tokens, reason) == ([other], "stop")
    # no EOS id (ignore_eos): the biased EOS is just a token
    tokens, _, reason = run_alone(hf, Request(id=6, prompt=prompt, max_tokens=5, logit_bias=pushed))
    assert (tokens, reason) == ([eos] * 5, "length")


def test_logprobs_are_the_models_log_softmax(engine, hf, tokenizer):
    prompt = prompt_token_ids(tokenizer, 10, 2)
    tokens, logprobs, _ = run_alone(engine, Request(id=7, prompt=prompt, max_tokens=6, logprobs=5))
    full = torch.tensor([prompt + tokens])
    expected = torch.log_softmax(hf.logits(full, torch.ones_like(full))[0].float(), -1)
    assert len(logprobs) == len(tokens)
    for i, (token, (value, top)) in enumerate(zip(tokens, logprobs)):
        row = expected[len(prompt) - 1 + i]
        assert abs(value - float(row[token])) < 1e-5
        assert len(top) == 5 and top[0][0] == token and top[0][1] == value  # greedy: the top one, same number
        assert [t for t, _ in top] == row.topk(5).indices.tolist()


def test_prompt_logprobs_and_n_rows_sharing_one_prefill(hf, tokenizer):
    prompt = prompt_token_ids(tokenizer, 15, 4)
    core = EngineCore(hf, 4, 128)
    calls = []
    prefill = core.runner.decoder.prefill_alone
    core.runner.decoder.prefill_alone = lambda *a: calls.append(1) or prefill(*a)
    requests = [Request(id=10 + i, prompt=prompt, max_tokens=5, do_sample=True, temperature=0.9, seed=40 + i,
                        prompt_logprobs=2 if i == 0 else None) for i in range(3)]
    for r in requests:
        core.add(r)
    result = core.step()
    assert len(calls) == 1 and result.prompt_tokens == len(prompt)  # three rows, one prefill
    assert list(result.prompt_logprobs) == [10]
    scored = result.prompt_logprobs[10]
    out = {r.id: list(result.tokens[r.id]) for r in requests}
    while core.scheduler.has_work():
        result = core.step()
        for rid, tokens in result.tokens.items():
            out[rid] += tokens
    for r in requests:
        ids = torch.tensor([prompt])
        alone = hf.generate(ids, torch.ones_like(ids), 5, do_sample=True, temperature=0.9, seed=r.seed)
        assert out[r.id] == alone.tokens[0, len(prompt):].tolist()
    assert len({tuple(v) for v in out.values()}) > 1  # seeds differ, so do the samples
    t = torch.tensor([prompt])
    expected = torch.log_softmax(hf.logits(t, torch.ones_like(t))[0].float(), -1)
    assert len(scored) == len(prompt) - 1
    for i, (value, top) in enumerate(scored):
        assert abs(value - float(expected[i, prompt[i + 1]])) < 1e-5
        assert [t for t, _ in top] == expected[i].topk(2).indices.tolist()


def test_a_prompt_is_scored_once_for_all_the_choices_that_ask(hf, tokenizer):
    """n choices with echo + logprobs: one scoring forward, the same log-probabilities for each (before,
    each choice scored the prompt again: n = 64 cost 64 forwards in one engine step)."""
    prompt = prompt_token_ids(tokenizer, 15, 5)
    core = EngineCore(hf, 4, 128)
    calls = []
    score = core.runner.score
    core.runner.score = lambda *a: calls.append(1) or score(*a)
    for i, k in enumerate((3, 3, 3, 1)):
        core.add(Request(id=20 + i, prompt=prompt, max_tokens=2, prompt_logprobs=k))
    result = core.step()
    assert len(calls) == 1
    scored = result.prompt_logprobs
    assert scored[20] == scored[21] == scored[22] and len(scored[20]) == len(prompt) - 1
    assert [(v, top[:1]) for v, top in scored[20]] == [(v, top) for v, top in scored[23]]  # top 1 of the same scores


def test_rules_refuse_bad_values():
    from plugins.core.config import ConfigError
    with pytest.raises(ConfigError, match="repetition_penalty must be > 0"):
        LogitRules(repetition_penalty=0.0)
    with pytest.raises(ConfigError, match="presence_penalty must be a finite number"):
        LogitRules(presence_penalty=float("nan"))


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.8)])
def test_sampled_tokens_follow_the_distribution_the_options_leave(top_k, top_p):
    """Sampler draws each token with its probability after temperature, top-k and top-p (within 4 standard
    errors over 40000 draws of a batch of two rows), never a token they drop, and the same tokens again
    from the same seed."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -float("inf")], [0.0, 0.0, 3.0, 1.0, -2.0, 0.5]])
    temperature, draws = 0.7, 20000
    sampler = Sampler(True, temperature, top_k, top_p, seed=11)
    counts = torch.zeros_like(logits, dtype=torch.float64)
    seen = []
    for _ in range(draws):
        tokens = sampler(logits)
        counts[torch.arange(2), tokens] += 1
        seen.append(tokens)
    want = (logits.double() / temperature).softmax(-1)
    for r in range(2):
        order = want[r].argsort(descending=True)
        kept = torch.zeros(6, dtype=torch.bool)
        kept[order[:top_k or 6]] = True
        kept &= torch.cat([torch.tensor([True]), want[r][order].cumsum(0)[:-1] < top_p])[order.argsort()]
        kept &= want[r] > 0
        want[r] = torch.where(kept, want[r], 0) / want[r][kept].sum()
    freq = counts / draws
    assert torch.all(freq[want == 0] == 0)
    assert torch.all((freq - want).abs() <= 4 * (want * (1 - want) / draws).sqrt() + 1e-12)
    again = Sampler(True, temperature, top_k, top_p, seed=11)
    assert all(torch.equal(again(logits), tokens) for tokens in seen[:50])

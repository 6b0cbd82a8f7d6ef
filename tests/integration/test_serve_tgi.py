"""TGI's own Python client, `text_generation.Client` (PyPI text-generation 0.7.0, in .venv-tgi: `make clients`),
against the live server as a TGI user points it: at the server's root URL. Plain and streamed greedy
generation equal `generate` alone (fp32), stop sequences end the text with them (TGI's way), details
carry the tokens and the prompt's log-probabilities, best_of answers its most likely sample, and a bad
request raises the client's own ValidationError."""

import json
import subprocess

import pytest
import torch
from live_server import REPO, Server

from plugins.engine.registry import load_backend

TGI_PYTHON = REPO / ".venv-tgi" / "bin" / "python"
pytestmark = pytest.mark.skipif(not TGI_PYTHON.exists(), reason="text-generation is installed by `make clients`")

# Runs in .venv-tgi: each call of the client, its answer as JSON (or the exception it raised)
DRIVER = r"""
import json, sys
from text_generation import Client

client = Client(sys.argv[1], timeout=120)
out = {}
for name, method, kwargs in json.loads(sys.argv[2]):
    try:
        if method == "generate_stream":
            out[name] = [r.model_dump(mode="json") for r in client.generate_stream(**kwargs)]
        else:
            out[name] = client.generate(**kwargs).model_dump(mode="json")
    except Exception as exc:
        out[name] = {"raised": type(exc).__name__, "message": str(exc)}
print(json.dumps(out))
"""
PROMPT = "def fibonacci(n):\n    "


@pytest.fixture(scope="module")
def engine(ckpt):
    return load_backend("hf", ckpt, dtype="float32")


@pytest.fixture(scope="module")
def answers(ckpt):
    server = Server(ckpt, "--backend", "hf")
    calls = [
        ("plain", "generate", {"prompt": PROMPT, "max_new_tokens": 12}),
        ("details", "generate", {"prompt": PROMPT, "max_new_tokens": 6, "decoder_input_details": True,
                                 "return_full_text": True}),
        ("stream", "generate_stream", {"prompt": PROMPT, "max_new_tokens": 12}),
        ("best_of", "generate", {"prompt": PROMPT, "max_new_tokens": 8, "best_of": 3, "do_sample": True}),
        ("too_long", "generate", {"prompt": PROMPT, "max_new_tokens": 10 ** 6}),
    ]
    try:
        first = run(server, calls)
        # stop on the text of the third greedy token: the client's stop_sequences
        stop = first["plain"]["details"]["tokens"][2]["text"]
        second = run(server, [("stop", "generate", {"prompt": PROMPT, "max_new_tokens": 12, "stop_sequences": [stop]})])
        assert "Traceback" not in server.output()
    finally:
        assert server.stop() == 0, server.output()
    return {**first, **second, "stop_sequence": stop}


def run(server, calls) -> dict:
    done = subprocess.run([str(TGI_PYTHON), "-c", DRIVER, server.url, json.dumps(calls)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def greedy_ids(engine, tokenizer, new: int) -> list[int]:
    ids = tokenizer.encode(PROMPT).ids
    t = torch.tensor([ids])
    out = engine.generate(t, torch.ones_like(t), new).tokens[0, len(ids):].tolist()
    return out[:out.index(0) + 1] if 0 in out else out


def test_generate_is_greedy_generate_alone(answers, engine, tokenizer):
    plain = answers["plain"]
    expected = greedy_ids(engine, tokenizer, 12)
    assert [t["id"] for t in plain["details"]["tokens"]] == expected
    assert plain["generated_text"] == tokenizer.decode(expected, skip_special_tokens=True)
    assert plain["details"]["finish_reason"] in ("length", "eos_token")
    assert plain["details"]["generated_tokens"] == len(expected)


def test_generate_stream_equals_generate(answers):
    events, plain = answers["stream"], answers["plain"]
    assert [e["token"]["id"] for e in events] == [t["id"] for t in plain["details"]["tokens"]]
    assert events[-1]["generated_text"] == plain["generated_text"] == "".join(e["token"]["text"] for e in events)
    assert events[-1]["details"]["finish_reason"] == plain["details"]["finish_reason"]
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])


def test_details_carry_the_prompts_logprobs(answers, engine, tokenizer):
    details = answers["details"]["details"]
    ids = tokenizer.encode(PROMPT).ids
    assert answers["details"]["generated_text"].startswith(PROMPT)
    assert [t["id"] for t in details["prefill"]] == ids and details["prefill"][0]["logprob"] is None
    t = torch.tensor([ids])
    logprobs = torch.log_softmax(engine.logits(t, torch.ones_like(t))[0].float(), -1)
    for i, token in enumerate(details["prefill"][1:], 1):
        assert abs(token["logprob"] - float(logprobs[i - 1, ids[i]])) < 1e-5


def test_stop_sequences_end_the_text_with_them(answers, tokenizer):
    stop, plain, stopped = answers["stop_sequence"], answers["plain"], answers["stop"]
    assert stopped["details"]["finish_reason"] == "stop_sequence"
    assert stopped["generated_text"].endswith(stop)
    assert plain["generated_text"].startswith(stopped["generated_text"])


def test_best_of_answers_its_most_likely_sample(answers):
    details = answers["best_of"]["details"]
    others = details["best_of_sequences"]
    assert len(others) == 2 and all(o["generated_tokens"] == 8 or o["finish_reason"] == "eos_token" for o in others)

    def total(d):
        return sum(t["logprob"] for t in d["tokens"])

    assert all(total(details) >= total(o) for o in others)
    assert len({details["seed"], *(o["seed"] for o in others)}) == 3


def test_a_bad_request_raises_the_clients_validation_error(answers):
    assert answers["too_long"]["raised"] == "ValidationError", answers["too_long"]
    assert "max_new_tokens" in answers["too_long"]["message"]

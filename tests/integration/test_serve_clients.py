"""The server against what real clients send: the openai SDK (n, logprobs, echo), the request bodies
of benchmark tools, eval harnesses and IDE plugins as their sources build them, TGI's API and vLLM's
tokenizer endpoints. Live server on 127.0.0.1, fp32, compared with the HF model's own numbers."""

import json
from pathlib import Path

import httpx2
import pytest
import torch
from live_server import CHAT_TEMPLATE, SLOTS, Server, with_chat_template

from plugins.core.tokenizer import prompt_token_ids
from plugins.engine.registry import load_backend


@pytest.fixture(scope="module")
def engine(ckpt):
    return load_backend("hf", ckpt, dtype="float32")


@pytest.fixture(scope="module")
def server(ckpt):
    s = Server(ckpt, "--backend", "hf")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def model(ckpt):
    return Path(ckpt).name


def greedy(engine, ids, new, **sampling):
    """What `generate` alone gives, cut after EOS (id 0) as the server stops there."""
    t = torch.tensor([ids])
    out = engine.generate(t, torch.ones_like(t), new, **sampling).tokens[0, len(ids):].tolist()
    return out[:out.index(0) + 1] if 0 in out else out


def text_of(tokenizer, ids):
    """The served text: special tokens left out (vLLM's skip_special_tokens default)."""
    return tokenizer.decode(ids, skip_special_tokens=True)


def log_softmax(engine, ids):
    t = torch.tensor([ids])
    return torch.log_softmax(engine.logits(t, torch.ones_like(t))[0].float(), -1)


def sse_events(raw: str) -> list:
    events = [e for e in raw.split("\n\n") if e.strip()]
    assert all(e.startswith("data:") for e in events), raw
    return [e[5:].strip() for e in events]


def post_stream(server, path, body) -> list:
    with httpx2.stream("POST", server.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return sse_events("".join(r.iter_text()))


def test_n_seeded_choices_are_reproducible_and_each_is_its_own_seed(server, engine, tokenizer, model):
    prompt = tokenizer.decode(prompt_token_ids(tokenizer, 11, 2))  # under one 16-token block: never cached
    computed = server.metric("mqa_prefill_tokens_total")
    asks = [server.client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0.9, n=SLOTS,
                                             seed=5) for _ in range(2)]
    assert server.metric("mqa_prefill_tokens_total") - computed == 2 * asks[0].usage.prompt_tokens  # once per ask
    texts = [[c.text for c in sorted(a.choices, key=lambda c: c.index)] for a in asks]
    assert texts[0] == texts[1] and len(set(texts[0])) > 1
    ids = tokenizer.encode(prompt).ids
    for i, text in enumerate(texts[0]):
        assert text == text_of(tokenizer, greedy(engine, ids, 8, do_sample=True, temperature=0.9, seed=5 + i))
    assert asks[0].usage.prompt_tokens == len(ids)


def test_n_above_the_free_slots_is_queued_not_refused(server, model):
    answer = server.client.completions.create(model=model, prompt="def f():", max_tokens=3, temperature=0,
                                              n=2 * SLOTS)
    assert sorted(c.index for c in answer.choices) == list(range(2 * SLOTS))
    assert len({c.text for c in answer.choices}) == 1  # greedy: all the same


def test_logprobs_are_hfs_log_softmax_and_top1_is_the_greedy_token(server, engine, tokenizer, model):
    ids = prompt_token_ids(tokenizer, 9, 6)
    answer = server.client.completions.create(model=model, prompt=ids, max_tokens=6, temperature=0, logprobs=5)
    lp = answer.choices[0].logprobs
    new = greedy(engine, ids, 6)
    expected = log_softmax(engine, ids + new)
    assert len(lp.token_logprobs) == 6
    for i, token in enumerate(new):
        row = expected[len(ids) - 1 + i]
        assert abs(lp.token_logprobs[i] - float(row[token])) < 1e-5
        top = lp.top_logprobs[i]
        assert len(top) == 5 and max(top.values()) == lp.token_logprobs[i]
        assert lp.tokens[i] == tokenizer.decode([token], skip_special_tokens=False)


def test_lm_eval_loglikelihood_body_is_the_prompts_log_likelihood(server, engine, tokenizer, model):
    """lm_eval/models/openai_completions.py (LocalCompletionsAPI._create_payload, generate=False): token-id
    prompts in a batch, echo + logprobs 1 + max_tokens 1; parse_logprobs sums token_logprobs[ctxlen:-1]."""
    prompts = [prompt_token_ids(tokenizer, 12, 7), prompt_token_ids(tokenizer, 8, 8)]
    body = {"model": model, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    out = httpx2.post(server.url + "/v1/completions", json=body, timeout=60).json()
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert len(choices) == 2
    for ids, choice in zip(prompts, choices):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
        expected = log_softmax(engine, ids)
        ctxlen = 4
        want = sum(float(expected[i - 1, ids[i]]) for i in range(ctxlen, len(ids)))
        assert abs(sum(lp["token_logprobs"][ctxlen:-1]) - want) < 1e-4
        greedy_ids = expected.argmax(-1).tolist()
        is_greedy = all(tok == max(top.values()) for tok, top in
                        zip(lp["token_logprobs"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1]))
        assert is_greedy == all(greedy_ids[i - 1] == ids[i] for i in range(ctxlen, len(ids)))
        assert choice["text"].startswith(tokenizer.decode(ids, skip_special_tokens=False))


def test_lm_eval_remote_tokenizer_probe(server, tokenizer):
    """lm_eval/utils.py check_remote_tokenizer_support and RemoteTokenizer: GET /tokenizer_info (eos_token),
    POST /tokenize {prompt, add_special_tokens: false} -> tokens, POST /detokenize {tokens} -> prompt."""
    info = httpx2.get(server.url + "/tokenizer_info").json()
    assert info["eos_token"] == "<|endoftext|>"
    text = "def add(a, b):\n    return a + b\n"
    tokens = httpx2.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert tokens["tokens"] == tokenizer.encode(text).ids and tokens["count"] == len(tokens["tokens"])
    eos = httpx2.post(server.url + "/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False})
    assert eos.json()["tokens"] == [0]
    back = httpx2.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert back == {"prompt": text}
    bad = httpx2.post(server.url + "/detokenize", json={"tokens": [10 ** 9]})
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]


def test_vllm_bench_serve_body(server, tokenizer, model):
    """vllm/benchmarks/lib/endpoint_request_func.py async_request_openai_completions: repetition_penalty,
    logprobs null, ignore_eos, stream_options.include_usage; usage read from the chunk without choices."""
    body = {"model": model, "prompt": tokenizer.decode(prompt_token_ids(tokenizer, 16, 9)), "repetition_penalty": 1.0,
            "max_tokens": 24, "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}
    events = post_stream(server, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 24  # EOS ignored: all 24
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_guidellm_body(server, tokenizer, model):
    """guidellm src/guidellm/backends/openai/request_handlers.py TextCompletionsRequestHandler.format:
    stop null, ignore_eos, continuous_usage_stats (usage read from any chunk, last wins)."""
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_tokens": 16, "stop": None, "ignore_eos": True, "prompt": "import os import sys"}
    chunks = [json.loads(e) for e in post_stream(server, "/v1/completions", body)[:-1]]
    assert all("usage" in c for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 16
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[0] < 16


def test_continue_starcoder_autocomplete_body(server, engine, tokenizer, model):
    """continuedev/continue core/llm/llms/OpenAI.ts _legacystreamComplete with the stableCodeFimTemplate stops
    (core/autocomplete/templating/AutocompleteTemplate.ts) plus getStopTokens.ts' starcoder2 extras: 13 stops."""
    stops = ["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<file_sep>", "<|endoftext|>", "</fim_middle>", "</code>",
             "/src/", "#- coding: utf-8", "```", "t.", "\nt", "<file_sep>"]
    prompt = "def add(a, b):\n    "
    body = {"model": model, "max_tokens": 12, "temperature": 0, "stream": True, "stop": stops, "prompt": prompt}
    chunks = [json.loads(e) for e in post_stream(server, "/v1/completions", body)[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    full = text_of(tokenizer, greedy(engine, tokenizer.encode(prompt).ids, 12))
    cut = min([full.find(s) for s in stops if s in full], default=len(full))
    assert text == full[:cut]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    models = httpx2.get(server.url + "/v1/models").json()  # core/llm/llms/Vllm.ts reads data[0].max_model_len
    assert models["data"][0]["max_model_len"] == 256


def test_tabby_body_every_event_is_json_until_a_finish_reason(server, engine, tokenizer, model):
    """TabbyML/tabby crates/http-api-bindings/src/completion/openai.rs: suffix null, presence_penalty 0.0; each
    event parsed as {choices: [{text, finish_reason}]}, the stream left at the first non-null finish_reason."""
    prompt = "<fim-prefix>def add(a, b):\n    <fim-suffix>\n<fim-middle>"
    body = {"model": model, "prompt": prompt, "suffix": None, "max_tokens": 10, "temperature": 0, "stream": True,
            "presence_penalty": 0.0}
    events = post_stream(server, "/v1/completions", body)
    text = ""
    for event in events:
        chunk = json.loads(event)  # Tabby's expect(): [DONE] must never be reached
        text += chunk["choices"][0]["text"]
        if chunk["choices"][0]["finish_reason"] is not None:
            break
    else:
        pytest.fail("no chunk carried a finish_reason")
    assert text == text_of(tokenizer, greedy(engine, tokenizer.encode(prompt).ids, 10))


def test_twinny_ollama_fields_are_ignored_and_named_once(server, model):
    """twinnydotdev/twinny src/extension/provider-options.ts createStreamRequestBodyFim (openai-compatible):
    Ollama's options and keep_alive, no max_tokens."""
    body = {"model": model, "prompt": "<fim-prefix>x = <fim-suffix>\n<fim-middle>", "stream": True,
            "keep_alive": "5m", "options": {"temperature": 0.2, "num_predict": 512}}
    for _ in range(2):
        events = post_stream(server, "/v1/completions", body)
        assert events[-1] == "[DONE]"
    ignoring = [line for line in server.output().splitlines() if line.startswith("ignoring request field")]
    assert sum("'options'" in line for line in ignoring) == 1 and sum("'keep_alive'" in line for line in ignoring) == 1


def test_llm_ls_tgi_generate_is_one_object(server, engine, tokenizer):
    """huggingface/llm-ls crates/llm-ls/src/backend.rs build_body / parse_tgi_text: {inputs, parameters} with
    return_full_text false; the answer must be one object with generated_text."""
    prompt = "<fim-prefix>def f(x):\n    <fim-suffix>\n<fim-middle>"
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 9, "return_full_text": False, "do_sample": False}}
    out = httpx2.post(server.url + "/generate", json=body, timeout=60).json()
    assert isinstance(out, dict)
    assert out["generated_text"] == text_of(tokenizer, greedy(engine, tokenizer.encode(prompt).ids, 9))


def test_tgi_generate_stream_and_details(server, engine, tokenizer):
    prompt = "class Stack:\n    def push(self"
    ids = tokenizer.encode(prompt).ids
    new = greedy(engine, ids, 7)
    params = {"max_new_tokens": 7, "details": True, "decoder_input_details": True, "return_full_text": True}
    out = httpx2.post(server.url + "/generate", json={"inputs": prompt, "parameters": params}, timeout=60).json()
    assert out["generated_text"] == prompt + text_of(tokenizer, new)
    details = out["details"]
    assert [t["id"] for t in details["tokens"]] == new[:len(details["tokens"])]
    assert details["generated_tokens"] == len(details["tokens"])
    expected = log_softmax(engine, ids + new)
    assert details["prefill"][0]["logprob"] is None and len(details["prefill"]) == len(ids)
    for i, t in enumerate(details["prefill"][1:], 1):
        assert abs(t["logprob"] - float(expected[i - 1, ids[i]])) < 1e-5
    events = [json.loads(e) for e in post_stream(server, "/generate_stream",
                                                 {"inputs": prompt, "parameters": {"max_new_tokens": 7}})]
    assert [e["token"]["id"] for e in events] == [t["id"] for t in details["tokens"]]
    assert [e["token"]["logprob"] for e in events] == pytest.approx([t["logprob"] for t in details["tokens"]], abs=1e-6)
    assert "".join(e["token"]["text"] for e in events) == events[-1]["generated_text"] == text_of(tokenizer, new)
    assert events[-1]["details"]["finish_reason"] in ("length", "eos_token")
    assert all(e["generated_text"] is None for e in events[:-1])


def test_bad_tgi_and_tokenize_requests_get_one_error(server):
    """TGI's routes answer TGI's ErrorResponse ({error, error_type}), the others OpenAI's."""
    for path, body, name in [("/generate", {"parameters": {}}, "inputs"),
                             ("/generate", {"inputs": "x", "parameters": {"watermark": True}}, "parameters.watermark"),
                             ("/generate_stream", {"inputs": "x", "parameters": {"max_new_tokens": 10 ** 6}},
                              "max_new_tokens"),
                             ("/", {"inputs": "x", "parameters": {"best_of": 2}}, "needs sampling"),
                             ("/tokenize", {"prompt": 5}, "prompt")]:
        r = httpx2.post(server.url + path, json=body)
        assert r.status_code == 400, (path, body, r.text)
        if path == "/tokenize":
            assert r.json()["error"]["param"] == name
        else:
            assert r.json()["error_type"] == "validation" and name in r.json()["error"], r.json()


@pytest.fixture(scope="module")
def chat_server(ckpt, tmp_path_factory):
    """The same weights, with a chat template in tokenizer_config.json (as transformers saves one)."""
    s = Server(with_chat_template(ckpt, tmp_path_factory.mktemp("chat") / "tiny-chat"), "--backend", "hf")
    yield s
    s.stop()


def rendered(tokenizer, messages):
    """The prompt as transformers renders the template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer.to_str()), eos_token="<|endoftext|>",
                                     chat_template=CHAT_TEMPLATE)
    return hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_chat_stream_equals_the_plain_answer_and_generate_on_the_rendered_prompt(chat_server, engine, tokenizer):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "A stack class"}]
    client = chat_server.client
    plain = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=10, temperature=0)
    pieces = list(client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert pieces[0].choices[0].delta.role == "assistant"
    text = "".join(p.choices[0].delta.content or "" for p in pieces if p.choices)
    expected = text_of(tokenizer, greedy(engine, tokenizer.encode(rendered(tokenizer, messages)).ids, 10))
    assert plain.choices[0].message.content == text == expected
    assert [p.choices[0].finish_reason for p in pieces if p.choices][-1] == plain.choices[0].finish_reason
    assert pieces[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert plain.usage.prompt_tokens == len(tokenizer.encode(rendered(tokenizer, messages)).ids)


def test_chat_render_is_the_rendered_prompt_tokenized(chat_server, tokenizer):
    messages = [{"role": "user", "content": "A queue class"}]
    r = httpx2.post(chat_server.url + "/v1/chat/completions/render",
                    json={"model": "tiny-chat", "messages": messages, "max_tokens": 5})
    assert r.status_code == 200, r.text
    assert r.json()["token_ids"] == tokenizer.encode(rendered(tokenizer, messages)).ids
    assert r.json()["sampling_params"]["max_tokens"] == 5 and r.json()["request_id"].startswith("chatcmpl-")


def test_chat_n_seeded_and_logprobs(chat_server, engine, tokenizer):
    """evalplus' OpenAI backend asks pass@k samples as chat completions with n > 1."""
    messages = [{"role": "user", "content": "def add(a, b):"}]
    asks = [chat_server.client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=6, n=3,
                                                       temperature=0.8, seed=11) for _ in range(2)]
    contents = [[c.message.content for c in sorted(a.choices, key=lambda c: c.index)] for a in asks]
    assert contents[0] == contents[1] and len(contents[0]) == 3
    ids = tokenizer.encode(rendered(tokenizer, messages)).ids
    for j, content in enumerate(contents[0]):
        assert content == text_of(tokenizer, greedy(engine, ids, 6, do_sample=True, temperature=0.8, seed=11 + j))
    answer = chat_server.client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=4,
                                                        temperature=0, logprobs=True, top_logprobs=3)
    content = answer.choices[0].logprobs.content
    new = greedy(engine, ids, 4)
    expected = log_softmax(engine, ids + new)
    for i, entry in enumerate(content):
        assert abs(entry.logprob - float(expected[len(ids) - 1 + i, new[i]])) < 1e-5
        assert entry.top_logprobs[0].logprob == entry.logprob and len(entry.top_logprobs) == 3


def test_guidellm_chat_body_content_parts(chat_server):
    """guidellm ChatCompletionsRequestHandler.format: a system string, user content as a list of parts,
    max_completion_tokens, stop null, ignore_eos, continuous usage."""
    body = {"model": "tiny-chat", "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_completion_tokens": 12, "stop": None, "ignore_eos": True,
            "messages": [{"role": "system", "content": "prefix"},
                         {"role": "user", "content": [{"type": "text", "text": "hello there"}]}]}
    chunks = [json.loads(e) for e in post_stream(chat_server, "/v1/chat/completions", body)[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 12 and chunks[-1]["choices"] == []
    assert all("usage" in c for c in chunks)


def test_chat_without_a_template_is_one_400(server, model):
    r = httpx2.post(server.url + "/v1/chat/completions", json={"model": model, "messages": [{"role": "user",
                                                                                             "content": "hi"}]})
    assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
    assert httpx2.get(server.url + "/tokenizer_info").json()["chat_template"] is None


def test_twinny_ollama_provider_gets_ollamas_stream(server, engine, tokenizer, model):
    """twinnydotdev/twinny src/extension/provider-options.ts createStreamRequestBodyFim (ollama provider, the
    body its openai-compatible provider sends too) and src/extension/providers/completion.ts onData: NDJSON
    lines read for `response`; Ollama's options name the sampling."""
    prompt = "<fim-prefix>def add(a, b):\n    <fim-suffix>\n<fim-middle>"
    body = {"model": model, "prompt": prompt, "stream": True, "keep_alive": "5m",
            "options": {"temperature": 0, "num_predict": 9}}
    with httpx2.stream("POST", server.url + "/api/generate", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line.strip()]
    assert all(not line["done"] for line in lines[:-1]) and lines[-1]["done"]
    assert "".join(line["response"] for line in lines) == \
        text_of(tokenizer, greedy(engine, tokenizer.encode(prompt).ids, 9))
    assert lines[-1]["eval_count"] == len(greedy(engine, tokenizer.encode(prompt).ids, 9))
    assert lines[-1]["done_reason"] in ("length", "stop")
    plain = httpx2.post(server.url + "/api/generate", json={**body, "stream": False}, timeout=60).json()
    assert plain["response"] == "".join(line["response"] for line in lines) and plain["done"]
    assert httpx2.get(server.url + "/api/tags").json()["models"][0]["name"] == model

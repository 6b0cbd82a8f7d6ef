"""vLLM's render endpoints: a request checked and tokenized exactly as it would be served, and nothing
generated. vllm-router asks `/v1/completions/render` before each completion to route on the prompt's
token ids (without it, the router falls back to /tokenize and then to the text).

POST /v1/completions/render -> a list with one GenerateRequest per prompt (vLLM's token-in request:
request_id, token_ids, sampling_params, model, stream); POST /v1/chat/completions/render -> one.
"""

from __future__ import annotations

from plugins.http.api import Sampling, completion_id, parse_completion, sampling, stop_list
from plugins.http.chat import chat_prompt, parse_chat
from plugins.http.completions import choice_requests
from plugins.http.served import Served


def sampling_params(req: Sampling, max_tokens: int) -> dict:
    """The request's sampling fields under vLLM's SamplingParams names and defaults."""
    return {"n": req.n or 1, "max_tokens": max_tokens, "min_tokens": req.min_tokens or 0,
            "temperature": 1.0 if req.temperature is None else float(req.temperature),
            "top_p": 1.0 if req.top_p is None else float(req.top_p),
            "top_k": -1 if not req.top_k else req.top_k, "min_p": float(req.min_p or 0.0),
            "seed": req.seed, "presence_penalty": float(req.presence_penalty or 0.0),
            "frequency_penalty": float(req.frequency_penalty or 0.0),
            "repetition_penalty": float(req.repetition_penalty or 1.0),
            "stop": stop_list(req), "stop_token_ids": list(req.stop_token_ids or []),
            "ignore_eos": bool(req.ignore_eos), "logprobs": req.top_logprobs_k,
            "prompt_logprobs": req.prompt_logprobs_k, "skip_special_tokens": req.skip_special_tokens is not False,
            "logit_bias": req.logit_bias}


def generate_request(served: Served, req: Sampling, ids: list[int], max_tokens: int, request_id: str) -> dict:
    sampling(req, served.vocab_size, served.eos)  # the vocabulary checks a completion makes
    return {"request_id": request_id, "token_ids": ids, "sampling_params": sampling_params(req, max_tokens),
            "model": served.model_id, "stream": bool(req.stream)}


async def render_completion(served: Served, http, body: bytes, arrived: float) -> list[dict]:
    req = parse_completion(body)
    served.note_ignored(req.ignored())
    served.check_model(req.model)
    prompts = [await served.prompt_ids(p, req.suffix) for p in req.prompts()]
    served.check(choice_requests(served, req, prompts, max(req.max_tokens, 1)))
    cid = completion_id()
    return [generate_request(served, req, ids, req.max_tokens, f"{cid}-{i}") for i, ids in enumerate(prompts)]


async def render_chat(served: Served, http, body: bytes, arrived: float) -> dict:
    req = parse_chat(body)
    prompt, max_tokens = await chat_prompt(served, req)
    served.check(choice_requests(served, req, [prompt], max_tokens))
    return generate_request(served, req, prompt, max_tokens, "chatcmpl-" + completion_id()[len("cmpl-"):])

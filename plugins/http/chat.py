"""POST /v1/chat/completions, where the checkpoint's tokenizer carries a chat template
(`tokenizer_config.json` `chat_template`): the messages are rendered by transformers'
`apply_chat_template` (the rendering every HF user gets), tokenized, and generated as completions are
(n choices, stop, logprobs, streaming)."""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Union

from fastapi import Request as HTTPRequest
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr
from starlette.concurrency import run_in_threadpool

from plugins.http.api import MAX_LOGPROBS, RequestError, Sampling, check_sampling, usage, validated
from plugins.http.completions import collect, sse_response, start_choices
from plugins.http.served import Served, merged


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: StrictStr
    text: StrictStr | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ...: handed to the template as they are
    role: StrictStr
    content: Union[StrictStr, list[ContentPart], None] = None

    def as_template_input(self) -> dict:
        """Content parts joined into one string (the text parts; vLLM's "string" content format)."""
        content = self.content
        if isinstance(content, list):
            other = [p.type for p in content if p.type != "text"]
            if other:
                raise RequestError(f"message content of type {other[0]!r} is not supported (text only)", "messages")
            content = "\n".join(p.text or "" for p in content)
        return {**(self.model_extra or {}), "role": self.role, "content": content}


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False

    @property
    def top_logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class ChatTemplate:
    """A chat template rendered as transformers renders it, over the served tokenizer's vocabulary."""

    def __init__(self, tokenizer, template: str, special: dict[str, str]):
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast

        try:  # a template that does not parse is refused at startup, not at the first chat request
            ImmutableSandboxedEnvironment().parse(template)
        except TemplateError as e:
            raise ValueError(f"the chat template does not parse: {e}") from None
        self.template = template
        self._hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer.to_str()),
                                           chat_template=template, **special)

    @classmethod
    def of_checkpoint(cls, checkpoint_dir, tokenizer) -> "ChatTemplate | None":
        """The directory's `tokenizer_config.json` template (a named list: its "default"), or None."""
        path = Path(checkpoint_dir) / "tokenizer_config.json"
        if not path.is_file():
            return None
        config = json.loads(path.read_text())
        template = config.get("chat_template")
        if isinstance(template, list):
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if not isinstance(template, str) or not template:
            return None
        special = {k: v for k, v in config.items() if k in ("bos_token", "eos_token", "unk_token", "pad_token")
                   and isinstance(v, str)}
        return cls(tokenizer, template, special)

    def render(self, messages: list[dict], add_generation_prompt: bool, continue_final_message: bool) -> str:
        return self._hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                            continue_final_message=continue_final_message)


def _logprobs(served: Served, ids: list[int], entries) -> list[dict]:
    """OpenAI's chat `logprobs.content` entries for these tokens."""
    def one(token: int, value: float) -> dict:
        text = served.tokenizer.decode([token], skip_special_tokens=False)
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    out = []
    for token, entry in zip(ids, entries or [None] * len(ids)):
        if entry is not None:
            value, top = entry
            out.append({**one(token, value), "top_logprobs": [one(t, v) for t, v in top]})
    return out


async def chat_prompt(served: Served, req: ChatRequest) -> tuple[list[int], int]:
    """The prompt's token ids and how many tokens to generate (the rest of the context by default)."""
    served.note_ignored(req.ignored())
    served.check_model(req.model)
    if served.chat is None:
        raise RequestError("this model has no chat template (its tokenizer_config.json has no `chat_template`): "
                           "use /v1/completions", "messages")
    messages = [m.as_template_input() for m in req.messages]
    try:
        text = await run_in_threadpool(served.chat.render, messages, req.add_generation_prompt,
                                       req.continue_final_message)
    except (TemplateError, ValueError) as e:  # the template's own raise_exception, a bad role order, ...
        raise RequestError(f"the chat template refused these messages: {e}", "messages") from None
    prompt = await served.prompt_ids(text, name="messages")
    check_sampling(req)
    return prompt, req.max_tokens if req.max_tokens is not None else served.capacity - len(prompt)


def parse_chat(body: bytes) -> ChatRequest:
    return validated(ChatRequest, body)


async def create_chat_completion(served: Served, http: HTTPRequest, body: bytes, arrived: float):
    req = parse_chat(body)
    prompt, max_tokens = await chat_prompt(served, req)
    gens = start_choices(served, req, [prompt], max_tokens, arrived)
    cid, created, model = "chatcmpl-" + secrets.token_hex(12), int(time.time()), served.model_id
    parts = [[] for _ in gens]
    logprobs = [[] for _ in gens]
    finish = [None] * len(gens)

    def current_usage():
        return usage(len(prompt), sum(g.completion_tokens for g in gens))

    def take(i, event):
        parts[i].append(event.text)
        lp = _logprobs(served, event.tokens, event.logprobs) if req.top_logprobs_k is not None else None
        if lp:
            logprobs[i] += lp
        finish[i] = event.finish or finish[i]
        return event.text, lp

    def chunk(choices: list[dict], with_usage: bool) -> dict:
        out = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
        if with_usage:
            out["usage"] = current_usage()
        return out

    if req.stream:
        options = req.stream_options
        continuous = bool(options and options.continuous_usage_stats)

        async def chunks():
            for i in range(len(gens)):  # the role first, as OpenAI sends it
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}], continuous)
            async for i, event in merged(gens):
                text, lp = take(i, event)
                if text or lp or finish[i]:
                    yield chunk([{"index": i, "delta": {"content": text} if text else {},
                                  "logprobs": {"content": lp} if lp else None, "finish_reason": finish[i]}],
                                continuous)

        final = (lambda: chunk([], True)) if options and options.include_usage else None
        return sse_response(cid, chunks(), final)

    await collect(http, gens, take)
    return {"id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": "".join(parts[i])},
                         "logprobs": {"content": logprobs[i]} if req.top_logprobs_k is not None else None,
                         "finish_reason": finish[i]} for i in range(len(gens))],
            "usage": current_usage()}

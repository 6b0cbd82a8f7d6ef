"""vLLM's tokenizer endpoints, which lm-evaluation-harness probes for its remote tokenizer:
POST /tokenize, POST /detokenize, GET /tokenizer_info."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr
from starlette.concurrency import run_in_threadpool

from plugins.http.api import RequestError, check_token_ids, validated
from plugins.http.served import Served
from plugins.http.text import EOS_NAMES


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool | None = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: StrictStr | None = None
    tokens: list[StrictInt]


async def tokenize(served: Served, http, body: bytes, arrived: float) -> dict:
    req = validated(TokenizeRequest, body)
    served.check_model(req.model)
    served.check_text_bytes(req.prompt, "prompt")
    encoding = await run_in_threadpool(served.tokenizer.encode, req.prompt,
                                       add_special_tokens=req.add_special_tokens)
    return {"count": len(encoding.ids), "max_model_len": served.capacity, "tokens": encoding.ids,
            "token_strs": encoding.tokens if req.return_token_strs else None}


async def detokenize(served: Served, http, body: bytes, arrived: float) -> dict:
    req = validated(DetokenizeRequest, body)
    served.check_model(req.model)
    if len(req.tokens) > served.capacity:
        raise RequestError(f"`tokens` holds {len(req.tokens)} tokens: more than this model's context of "
                           f"{served.capacity}", "tokens")
    check_token_ids(req.tokens, served.vocab_size, "tokens")
    return {"prompt": await run_in_threadpool(served.tokenizer.decode, req.tokens, skip_special_tokens=False)}


def tokenizer_info(served: Served) -> dict:
    """The special tokens and limits a remote client needs (the fields of transformers'
    tokenizer_config.json that vLLM's /tokenizer_info returns)."""
    eos = next((name for name in EOS_NAMES if served.tokenizer.token_to_id(name) is not None), None)
    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": eos, "unk_token": eos,
            "pad_token": None, "model_max_length": served.capacity, "vocab_size": served.vocab_size,
            "chat_template": served.chat.template if served.chat is not None else None}

"""The injected model's fast decode step: `InjectedDecoder`, and its optional `torch.compile`.

One-token steps skip HF's model forward (its mask building and checks): embeddings -> the
injected layers on the preallocated cache -> ln_f -> LM head, the LM head on the same CPU linears
as the layers (`plugins.kernels`). A speculative verify of several tokens takes the same path with
each token computed as its own step would be; prefill runs HF's forward.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from plugins.core.arch import arch
from plugins.core.tensors import beyond_window
from plugins.engine.hf_model import HFDecoder
from plugins.engine.kv_cache import Segments
from plugins.kernels import PackedWeights, linear, rows_alone


class Trunk:
    """The injected model's embeddings, layers and final norm, whichever family: gpt_bigcode (learned
    positions added to the embeddings) or starcoder2 (RoPE: the layers get HF's cos / sin)."""

    def __init__(self, model):
        self.rope = arch(model.config).rope
        base = model.model if self.rope else model.transformer
        self.base = base
        self.layers = base.layers if self.rope else base.h
        self.norm = base.norm if self.rope else base.ln_f

    def __call__(self, ids, positions, cache, mask):
        """The hidden states after the last layer (before the final norm)."""
        if not self.rope:
            h = self.base.wte(ids) + self.base.wpe(positions)
            for block in self.layers:
                h = block(h, None, layer_past=cache, attention_mask=mask)
            return h
        h = self.base.embed_tokens(ids)
        cos_sin = self.base.rotary_emb(h, positions)
        for layer in self.layers:
            h = layer(h, attention_mask=mask, cache=cache, position_embeddings=cos_sin)
        return h


class InjectedDecoder(HFDecoder):
    """`HFDecoder` with the fast one-token step. A padded batch's 4-D mask is a preallocated boolean
    row written in place each step; an unpadded batch needs none. A sliding window (StarCoder2) is part
    of every mask this decoder builds, in positions (plugins.core.tensors.beyond_window); without a mask
    the attention op applies it itself."""

    def __init__(self, model, cache, compile: bool = False):
        super().__init__(model, cache)
        layer = cache.layers[0]
        batch = layer.keys.shape[0] if layer.is_initialized else 1
        self.keep = torch.ones(batch, 1, 1, layer.capacity, dtype=torch.bool, device=model.device)
        self.padded = False
        self.window = arch(model.config).sliding_window
        self.trunk = Trunk(model)
        self.packs = head_packs(model)
        self.step = compiled(self._step, cache) if compile else self._step

    def _step(self, tokens, position_ids, mask):
        h = self.trunk.norm(self.trunk(tokens, position_ids, self.cache, mask))
        if self.packs is None:
            return self.model.lm_head(h)
        return linear(h, self.model.lm_head.weight, None, False, self.packs)

    def _rows_mask(self, attention_mask):
        """The preallocated [n, 1, 1, S] mask of a padded one-token step, written in place."""
        mask = self.keep[:attention_mask.shape[0], :, :, :attention_mask.shape[1]]  # a pool decodes its first rows
        mask.copy_(attention_mask[:, None, None, :])
        far = beyond_window(attention_mask, 1, self.window)
        if far is not None:
            mask &= ~far
        return mask

    def prefill(self, input_ids, attention_mask, position_ids):
        self.padded = not bool(attention_mask.all())
        return super().prefill(input_ids, attention_mask, position_ids)

    def decode(self, tokens, attention_mask, position_ids):
        mask = self._rows_mask(attention_mask) if self.padded else None
        return self.step(tokens, position_ids, mask)[:, -1]

    def mixed(self, tokens, attention_mask, position_ids, chunks, shared=None):
        """One forward of the pool's decode step and prompt chunks (chunked prefill): `tokens` /
        `position_ids` [n, 1] and `attention_mask` [n, t + 1] as `decode` takes them; `chunks` a list of
        (one-row cache holding the prompt's earlier columns, chunk ids [1, C], positions [1, C]); `shared`:
        chunk index -> `SharedPrefix`, the columns it takes from an earlier chunk instead. The
        linears run once over every token (the weights are read once per step, not once per chunk);
        attention per sequence (plugins.engine.kv_cache.Segments). Returns (logits [n, V], the
        logits of each chunk's last token [1, V])."""
        n = tokens.shape[0]
        ids = torch.cat([tokens.view(1, n)] + [c for _, c, _ in chunks], 1)
        pos = torch.cat([position_ids.view(1, n)] + [p for _, _, p in chunks], 1)
        mask = self._rows_mask(attention_mask)
        cache = Segments(self.cache, n, [(c, ids_.shape[1]) for c, ids_, _ in chunks], shared or {})
        h = self.trunk(ids, pos, cache, mask)
        ends = torch.tensor([c.shape[1] for _, c, _ in chunks], device=h.device).cumsum(0) + n - 1
        h = self.trunk.norm(torch.cat([h[0, :n], h[0, ends]]))
        logits = self.model.lm_head(h) if self.packs is None else linear(h, self.model.lm_head.weight, None, False,
                                                                         self.packs)
        return logits[:n], [logits[n + i:n + i + 1] for i in range(len(chunks))]

    def verify(self, tokens, attention_mask, position_ids):
        """Logits of several new tokens per row [n, w, V] in one batched forward (the server's
        speculative verify): the linears as for n * w rows, attention under a causal + padding mask.
        Cheaper than `forward_tokens` by the batch's GEMMs, at the price of its exactness: where a
        rung's kernels are not row-invariant (bf16 on AMX), a near-tie may break the other way than a
        one-token step would."""
        return self._step(tokens, position_ids, self._tokens_mask(attention_mask, tokens.shape[1]))

    def _tokens_mask(self, attention_mask, w: int):
        """[n, 1, w, S]: padding, causality among the w new tokens (the last columns), the window."""
        length = attention_mask.shape[1]
        causal = torch.ones(w, length, dtype=torch.bool, device=attention_mask.device).tril(length - w)
        mask = attention_mask.bool()[:, None, None, :] & causal
        far = beyond_window(attention_mask, w, self.window)
        return mask if far is None else mask & ~far

    def forward_tokens(self, tokens, attention_mask, position_ids):
        """Logits of several new tokens (a speculative verify): every row computed with the arithmetic of
        a one-token step (row-invariant linears, one attention per token), so the verified tokens are
        exactly those plain decoding would pick."""
        if tokens.shape[1] == 1:
            return self.decode(tokens, attention_mask, position_ids)[:, None]
        mask = None
        if self.padded:  # each row's mask over the columns up to itself (the layer slices it per row)
            mask = (attention_mask[:, None, None, :].bool() if self.window is None
                    else self._tokens_mask(attention_mask, tokens.shape[1]))
        with rows_alone():
            return self._step(tokens, position_ids, mask)


def head_packs(model) -> PackedWeights | None:
    """The LM head's weight packs, made once per model, not per generate() call (packing the head is not
    free); None for an int8 head (quantize_lm_head), which runs as its own module."""
    head = model.lm_head
    if type(head) is not nn.Linear:
        return None
    if not hasattr(head, "decode_packs"):
        head.decode_packs = PackedWeights()
    return head.decode_packs


def compiled(step, cache):
    """torch.compile(step), falling back to eager (with a warning) where compiling is unavailable or fails."""
    try:
        # freezing: weights become constants that inductor prepacks for oneDNN (CPU)
        fast = torch.compile(step, dynamic=True, options={"freezing": True})
    except Exception as exc:  # e.g. no compiler toolchain, unsupported Python
        warnings.warn(f"torch.compile unavailable ({type(exc).__name__}: {exc}); decoding eagerly")
        return step
    state = {"fn": fast}

    def run(*args):
        length = cache.get_seq_length()
        try:
            return state["fn"](*args)
        except Exception as exc:
            if state["fn"] is step:
                raise
            warnings.warn(f"torch.compile of the decode step failed ({type(exc).__name__}: {exc}); "
                          "decoding eagerly from now on")
            cache.crop(length)  # undo what a partly run compiled step wrote
            state["fn"] = step
            return step(*args)

    return run

"""Text in and out of the server: the tokenizer, fill-in-the-middle prompts, streamed detokenization.

All of it runs in the HTTP workers, never in the decode loop.
"""

from __future__ import annotations

from tokenizers import Tokenizer

# Prefix-suffix-middle order, as SantaCoder and StarCoder were trained. The spellings differ
# (SantaCoder `<fim-prefix>`, StarCoder `<fim_prefix>`): whichever the tokenizer holds is used.
FIM_ROLES = ("prefix", "suffix", "middle")
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>")


def special_id(tok: Tokenizer, names) -> int | None:
    for name in names:
        token_id = tok.token_to_id(name)
        if token_id is not None:
            return token_id
    return None


def fim_ids(tok: Tokenizer) -> dict[str, int] | None:
    """{"prefix": id, "suffix": id, "middle": id} from the tokenizer's vocabulary, or None."""
    found = {role: special_id(tok, (f"<fim-{role}>", f"<fim_{role}>")) for role in FIM_ROLES}
    return found if all(v is not None for v in found.values()) else None


def encode_prompt(tok: Tokenizer, prompt: str, suffix: str | None = None) -> list[int]:
    """Token ids of `prompt`; with `suffix`, the fill-in-the-middle prompt prefix-suffix-middle."""
    if suffix is None:
        return tok.encode(prompt).ids
    fim = fim_ids(tok)
    if fim is None:
        raise ValueError("`suffix` needs fill-in-the-middle tokens, and this model's tokenizer has none")
    return ([fim["prefix"]] + tok.encode(prompt).ids + [fim["suffix"]] + tok.encode(suffix).ids
            + [fim["middle"]])


class StreamText:
    """Token ids in, text out, as it becomes final.

    Text is released only when it cannot change: a byte-level token may end inside a UTF-8
    character (the decoder then shows U+FFFD until the rest arrives), and the tail that could be
    the start of a stop string is held back until it is known not to be one. Each call decodes only
    the tokens since the last complete character (plus those of the text before it, for context), so
    a long completion costs the same per token as a short one.
    """

    def __init__(self, tok: Tokenizer, stop: list[str] = (), skip_ids: set[int] = frozenset(),
                 include_stop: bool = False):
        """`include_stop`: the text ends with the stop string that ended it (TGI's way), else before it
        (OpenAI's)."""
        self.tok, self.stop, self.skip = tok, [s for s in stop if s], skip_ids
        self.include_stop = include_stop
        self.ids: list[int] = []  # every token fed (the usage count)
        self._kept: list[int] = []  # those that make text (EOS and other skipped ids left out)
        self._prefix = self._read = 0  # _kept[_prefix:_read] decoded to the last complete text
        self.text = ""        # decoded so far (complete characters only)
        self.sent = 0         # characters of `text` released
        self.stopped = False

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def _advance(self, final: bool = False) -> None:
        before = self._decode(self._kept[self._prefix:self._read])
        now = self._decode(self._kept[self._prefix:])
        if len(now) > len(before) and (final or not now.endswith("\ufffd")):
            self.text += now[len(before):]
            self._prefix, self._read = self._read, len(self._kept)

    def add(self, ids: list[int]) -> str:
        """Feed new tokens; returns the text now final (maybe ""). After a stop string, returns nothing more."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        self._kept.extend(i for i in ids if i not in self.skip)
        self._advance()
        hits = [(i, len(s)) for i, s in ((self.text.find(s, self.sent), s) for s in self.stop) if i >= 0]
        if hits:  # (the released text holds none)
            self.stopped = True
            at, length = min(hits)
            return self._release(at + length if self.include_stop else at)
        hold = max((self._partial_stop(s) for s in self.stop), default=0)
        return self._release(len(self.text) - hold)

    def flush(self) -> str:
        """At the end of generation: whatever is left (a held-back prefix that never became a stop string,
        an incomplete character as U+FFFD)."""
        if self.stopped:
            return ""
        self._advance(final=True)
        return self._release(len(self.text))

    def _partial_stop(self, stop: str) -> int:
        """Length of the longest tail of the text that is a proper prefix of `stop`."""
        for k in range(min(len(stop) - 1, len(self.text) - self.sent), 0, -1):
            if self.text.endswith(stop[:k]):
                return k
        return 0

    def _release(self, end: int) -> str:
        end = max(end, self.sent)
        out, self.sent = self.text[self.sent:end], end
        return out

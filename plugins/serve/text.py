"""Text in and out of the server: the tokenizer, fill-in-the-middle prompts, streamed detokenization.

All of it runs in the HTTP workers, never in the decode loop.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from plugins.core.tokenizer import TOKENIZER_FILE

# Prefix-suffix-middle order, as SantaCoder and StarCoder were trained. The spellings differ
# (SantaCoder `<fim-prefix>`, StarCoder `<fim_prefix>`): whichever the tokenizer holds is used.
FIM_ROLES = ("prefix", "suffix", "middle")
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>")


def load_tokenizer(checkpoint_dir: str | Path) -> tuple[Tokenizer, Path]:
    """The checkpoint's own `tokenizer.json`, else the project's (what our checkpoints are built for)."""
    own = Path(checkpoint_dir) / "tokenizer.json"
    path = own if own.is_file() else TOKENIZER_FILE
    return Tokenizer.from_file(str(path)), path


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
    the start of a stop string is held back until it is known not to be one.
    """

    def __init__(self, tok: Tokenizer, stop: list[str] = (), skip_ids: set[int] = frozenset()):
        self.tok, self.stop, self.skip = tok, [s for s in stop if s], skip_ids
        self.ids: list[int] = []
        self.text = ""        # decoded so far (complete characters only)
        self.sent = 0         # characters of `text` released
        self.stopped = False

    def _decoded(self) -> str:
        return self.tok.decode([i for i in self.ids if i not in self.skip], skip_special_tokens=False)

    def add(self, ids: list[int]) -> str:
        """Feed new tokens; returns the text now final (maybe ""). After a stop string, returns nothing more."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        text = self._decoded()
        if text.endswith("\ufffd"):
            return ""  # a character still incomplete: wait for its next byte(s)
        self.text = text
        hits = [i for i in (text.find(s, self.sent) for s in self.stop) if i >= 0]  # released text holds none
        if hits:
            self.stopped = True
            return self._release(min(hits))
        hold = max((self._partial_stop(s) for s in self.stop), default=0)
        return self._release(len(text) - hold)

    def flush(self) -> str:
        """At the end of generation: whatever is left (a held-back prefix that never became a stop string)."""
        if self.stopped:
            return ""
        self.text = self._decoded()
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

    @property
    def released(self) -> str:
        return self.text[:self.sent]

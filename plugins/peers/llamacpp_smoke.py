"""`python -m plugins.peers.llamacpp_smoke BUILD_DIR`: does a llama.cpp build run on this machine?

scripts/build_llamacpp.sh runs it on a fresh build before renaming it into place: a tiny seeded
checkpoint converted to GGUF (f32 and q8_0, the type whose AMX kernel once died with SIGILL), one
forward each on a left-padded batch, in the llama.cpp worker process. Exit 0 when both ran and f32
matches HF; else 1 with the reason (a crash is named by its signal).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path


def main(build: str) -> int:
    os.environ["PLUGINS_LLAMACPP_DIR"] = str(Path(build).resolve())
    from plugins.core.checkpoint import create_checkpoint
    from plugins.core.config import load_model_config
    from plugins.core.tokenizer import left_pad, load_tokenizer, prompt_token_ids
    from plugins.engine.registry import load_backend

    tok = load_tokenizer()
    ids, mask = left_pad([prompt_token_ids(tok, n, i) for i, n in enumerate((5, 9))])
    with tempfile.TemporaryDirectory(prefix="llamacpp-smoke-") as tmp:
        ckpt = create_checkpoint(load_model_config("tiny"), Path(tmp) / "tiny", seed=0)
        want = load_backend("hf", ckpt).logits(ids, mask)
        for weights, bound in (("f32", 2e-3), ("q8_0", 0.05)):
            try:
                engine = load_backend("llama.cpp", ckpt, weights=weights)
                got = engine.logits(ids, mask)
                engine.close()
            except Exception as exc:
                print(f"llama.cpp smoke test: {weights} forward failed: {str(exc).splitlines()[0]}", file=sys.stderr)
                return 1
            diff = float((got - want)[mask.bool()].abs().max())
            if not diff < bound:
                print(f"llama.cpp smoke test: {weights} logits off HF's by {diff:.3g} (bound {bound})", file=sys.stderr)
                return 1
            print(f"llama.cpp smoke test: {weights} forward ran, max |logit - HF| {diff:.2e}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__.split("\n\n")[0])
    sys.exit(main(sys.argv[1]))

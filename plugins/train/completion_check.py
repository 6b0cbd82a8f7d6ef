"""Does a trained model write Python? Greedy completions of held-out method bodies, checked with `ast`.

  python -m plugins.train.completion_check checkpoints/code-mqa-trained
  python -m plugins.train.completion_check CKPT --n 12 --seed 0 --method asyncio/futures.py:cancelled

Methods: functions defined directly in a class of a held-out file (plugins.train.data), whose
docstring is one line and which have a statement after it; `--n` of them, drawn with `--seed`.
Prompt: the file up to the docstring's closing quotes (its last `--prompt-tokens` tokens, the
checkpoint's own tokenizer, fewer if the model's n_positions needs); greedy, `--new-tokens` new
tokens, HF fp32.

A completion *parses* when the method's header and docstring (dedented to column 0) followed by its
complete generated body lines compile with `ast.parse`: complete lines are those ended by a newline
(the last, cut-off line is dropped), and the body stops at the first non-blank line indented less
than the body (the method ended); at least one non-blank body line is required. A completion is
*degenerate* when it has no complete non-blank line, when one stripped line makes up 3 or more of
them, or when any of its lines (the cut-off one included) repeats a piece holding a letter or digit
4 or more times in a row (`x, x, x, x`, `_to_to_to_to`).
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import re
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

REPEATS = 3  # a line this many times in 64 tokens is a loop, not code
_RUN = re.compile(r"(.{2,}?)\1{3,}")  # a piece of 2+ characters, then 3+ copies of it


@dataclass
class Method:
    file: str        # relative to the stdlib root
    name: str        # Class.method
    prefix: str      # the file up to and including the docstring's closing quotes
    header: str      # the def line(s) and docstring, dedented to column 0
    indent: int      # the def's column
    reference: str   # the real first body line, stripped


def methods_of(relative: str, source: str) -> list[Method]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = [x + "\n" for x in source.split("\n")]  # ast counts lines by "\n" only (not \f, \x1c, ...)
    found = []
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        for fn in cls.body:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(fn.body) < 2:
                continue
            doc = fn.body[0]
            if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                    and isinstance(doc.value.value, str) and doc.lineno == doc.end_lineno):
                continue
            end = sum(len(x) for x in lines[:doc.end_lineno - 1]) + len(
                lines[doc.end_lineno - 1].encode()[:doc.end_col_offset].decode())
            header = "".join(x[fn.col_offset:] for x in lines[fn.lineno - 1:doc.end_lineno]).rstrip("\n")
            try:  # a signature continued left of the def (rare) does not dedent cleanly: skip it
                ast.parse(header)
            except SyntaxError:
                continue
            found.append(Method(relative, f"{cls.name}.{fn.name}", source[:end], header, fn.col_offset,
                                lines[fn.body[1].lineno - 1].strip()))
    return found


def heldout_methods(n: int, seed: int = 0) -> list[Method]:
    from plugins.train.data import relative_name, split_files

    every = []
    for f in split_files()[1]:
        every += methods_of(relative_name(f), Path(f).read_text(encoding="utf-8", errors="replace"))
    every.sort(key=lambda m: (m.file, m.name, len(m.prefix)))
    return random.Random(seed).sample(every, min(n, len(every)))


def find_method(spec: str) -> Method:
    """`asyncio/futures.py:cancelled` or `asyncio/futures.py:Future.cancelled` among the held-out files."""
    from plugins.train.data import relative_name, split_files

    file, _, name = spec.partition(":")
    for f in split_files()[1]:
        if relative_name(f) == file:
            for m in methods_of(file, Path(f).read_text(encoding="utf-8", errors="replace")):
                if name in (m.name, m.name.split(".")[-1]):
                    return m
            raise ValueError(f"{file} has no method {name!r} with a one-line docstring and a body")
    raise ValueError(f"{file!r} is not a held-out file")


def body_lines(method: Method, completion: str) -> list[str]:
    """The complete generated lines that belong to the method's body."""
    complete = completion.split("\n")[:-1]
    if complete and complete[0].strip() == "":  # the rest of the docstring's line (nothing)
        complete = complete[1:]
    body = []
    for line in complete:
        if line.strip() and len(line) - len(line.lstrip()) <= method.indent:
            break
        body.append(line)
    return body


def parses(method: Method, completion: str) -> bool:
    body = body_lines(method, completion)
    if not any(x.strip() for x in body):
        return False
    cut = method.indent
    if any(x.strip() and x[:cut].strip() for x in body):  # tabs or odd indentation: not this def's body
        return False
    try:
        ast.parse(method.header + "\n" + "\n".join(x[cut:] for x in body) + "\n")
    except SyntaxError:
        return False
    return True


def degenerate(completion: str) -> bool:
    lines = [x.strip() for x in completion.split("\n")[:-1] if x.strip()]
    if not lines or Counter(lines).most_common(1)[0][1] >= REPEATS:
        return True
    return any(any(c.isalnum() for c in m.group(1)) for x in completion.split("\n") for m in _RUN.finditer(x.strip()))


def complete(model, tok, methods: list[Method], prompt_tokens: int = 400, new_tokens: int = 48) -> list[dict]:
    import torch

    from plugins.core.tokenizer import EOS_ID

    keep = min(prompt_tokens, model.config.n_positions - new_tokens)  # the prompt and the answer fit the model
    if keep < 1:
        raise ValueError(f"{new_tokens} new tokens leave no room for a prompt in n_positions "
                         f"{model.config.n_positions}")
    out = []
    for m in methods:
        ids = tok.encode(m.prefix).ids[-keep:]
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 do_sample=False, max_new_tokens=new_tokens, pad_token_id=EOS_ID, eos_token_id=EOS_ID)
        new = [t for t in gen[0, len(ids):].tolist() if t != EOS_ID]
        text = tok.decode(new)
        out.append({**asdict(m), "completion": text, "parses": parses(m, text), "degenerate": degenerate(text)})
    return out


def show(row: dict) -> str:
    pad = " " * row["indent"]
    head = "\n".join(pad + x for x in row["header"].split("\n"))
    verdict = ("parses" if row["parses"] else "does not parse") + (", degenerate" if row["degenerate"] else "")
    return (f"--- {row['file']} {row['name']} ({verdict}; real next line: {row['reference']})\n"
            f"{head}\u2588{row['completion']}\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path, help="a trained HF checkpoint dir (its tokenizer.json is used)")
    ap.add_argument("--n", type=int, default=12, help="held-out methods drawn")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--prompt-tokens", type=int, default=400)
    ap.add_argument("--method", action="append", default=[], help="FILE:NAME also completed and shown (not counted)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, help="write every completion and verdict here")
    args = ap.parse_args(argv)

    from plugins.core.console import exit_without_collecting, quiet_upstream

    quiet_upstream()
    exit_without_collecting()
    import torch

    from plugins.core.checkpoint import load_hf_model
    from plugins.core.tokenizer import checkpoint_tokenizer

    torch.set_num_threads(args.threads)
    tok, _ = checkpoint_tokenizer(args.checkpoint)
    model = load_hf_model(args.checkpoint, dtype=torch.float32).eval()
    try:
        extra = [find_method(s) for s in args.method]
    except ValueError as e:
        ap.error(str(e))
    rows = complete(model, tok, heldout_methods(args.n, args.seed), args.prompt_tokens, args.new_tokens)
    shown = complete(model, tok, extra, args.prompt_tokens, args.new_tokens)
    for row in shown + rows:
        print(show(row))
    ok = sum(r["parses"] for r in rows)
    fine = sum(not r["degenerate"] for r in rows)
    both = sum(r["parses"] and not r["degenerate"] for r in rows)
    keep = min(args.prompt_tokens, model.config.n_positions - args.new_tokens)
    summary = {"checkpoint": str(args.checkpoint), "methods": len(rows), "parse": ok, "non_degenerate": fine,
               "parse_and_non_degenerate": both, "seed": args.seed, "new_tokens": args.new_tokens,
               "prompt_tokens": keep}
    print(f"{args.checkpoint}: {ok}/{len(rows)} parse, {fine}/{len(rows)} non-degenerate, {both}/{len(rows)} both "
          f"(seed {args.seed}, prompts of <= {keep} tokens, {args.new_tokens} new tokens, greedy, HF fp32)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**summary, "completions": rows, "shown": shown}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

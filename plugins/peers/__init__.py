"""Engines a user would pick instead of ours, behind the same Backend protocol, converted from our
checkpoints by each project's own converter: CTranslate2 (ctranslate2.py), llama.cpp (llamacpp.py).

Each runs in a worker process of its own (`plugins.launch.launcher`, launcher 'process'): their native
code is not ours, and a crash in it (SIGILL from an instruction the build assumed, a segfault) must end
that engine's rows with one clear error, not the bench or the test session that loaded it."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from plugins.core.checkpoint import read_hf_config
from plugins.core.hf_files import ARCHITECTURES, is_complete, write_companions


def in_own_process(cls, hf_dir, dtype, options: dict):
    """`cls.from_hf(hf_dir, dtype, **options)` run in a worker process (a RemoteBackend), when called
    outside one; None inside the worker, where the engine loads in-process."""
    from plugins.launch.launcher import RemoteBackend
    from plugins.launch.worker import in_worker

    if in_worker():
        return None
    import torch

    # the caller's thread count, as an in-process engine would take it
    options = {**options, "threads": options.get("threads") or torch.get_num_threads()}
    return RemoteBackend(cls.name, hf_dir, dtype=dtype, tp_size=1, launcher="process", **options)


@contextlib.contextmanager
def staged_checkpoint(hf_dir: Path, tmp: Path):
    """Our checkpoint as other projects' HF converters read it. A complete one (plugins.core.hf_files:
    every checkpoint written now) is read where it is; one written before checkpoints carried their
    tokenizer is staged in `tmp / "hf"` (removed afterwards): its files symlinked, config.json with
    `architectures` (their model class) and the tokenizer and generation files it lacks."""
    hf_dir = Path(hf_dir)
    if is_complete(hf_dir):
        yield hf_dir
        return
    staged = tmp / "hf"
    staged.mkdir()
    try:
        for f in hf_dir.iterdir():
            if f.is_file() and f.name != "config.json":
                os.symlink(f.resolve(), staged / f.name)
        config = json.loads((hf_dir / "config.json").read_text())
        config.setdefault("architectures", ARCHITECTURES)
        (staged / "config.json").write_text(json.dumps(config))
        write_companions(staged, read_hf_config(hf_dir))
        yield staged
    finally:
        for f in staged.iterdir():
            f.unlink()
        staged.rmdir()

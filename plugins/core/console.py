"""What the command-line tools print: known upstream noise filtered, slow first runs announced.

`quiet_upstream()` and `exit_without_collecting()` are called by our entry points (compare, convert,
make-checkpoint, serve, the TP workers) only: used as a library, the project leaves warnings, logging
and the garbage collector to the application.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
import warnings

# Warnings the stack prints on every run that say nothing about the user's run (FutureWarnings of
# transformers / torch APIs we do not call, megatron-core's "Transformer Engine and Apex are not
# installed" when importing its optimizers, DeepSpeed's accelerator guess on a CPU machine).
NOISE = (r".*(Apex|Transformer Engine|transformer_engine|TE is not installed|apex).*",
         r".*Setting accelerator to CPU.*", r".*torch\.distributed\.checkpoint.*")


def quiet_upstream() -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    for pattern in NOISE:
        warnings.filterwarnings("ignore", message=pattern)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"(deepspeed|megatron|torch\.distributed)(\..*)?")
    for name in ("DeepSpeed", "megatron", "torch.distributed", "torch.distributed.checkpoint"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d's rendezvous chatter in TP workers


def exit_without_collecting() -> None:
    """Have this process skip the garbage collections of the interpreter's teardown: with torch and
    megatron-core imported they take about a second, paid by every rank, server and CLI run before its
    parent sees it exit. Registered early, so it runs after the atexit handlers registered later."""
    atexit.register(gc.freeze)


def announce(message: str) -> None:
    """A one-line note on stderr for a wait the user would otherwise sit through in silence."""
    print(message, file=sys.stderr, flush=True)


def extension_built(name: str) -> bool:
    """Whether torch's JIT extension loader has a built `name` in its cache ($TORCH_EXTENSIONS_DIR)."""
    from torch.utils.cpp_extension import _get_build_directory

    try:
        return any(p.endswith(".so") for p in os.listdir(_get_build_directory(name, verbose=False)))
    except OSError:
        return False

"""Megatron-LM `model_optim_rng.pt` files read without running any of their code: torch's
weights-only unpickler, with Megatron's pickled enums replaced by inert stand-ins; and the nested
state-dict tree of such a file as flat "a/b/c" keys and back."""

from __future__ import annotations

import enum
import signal
from argparse import Namespace
from io import BytesIO
from pathlib import Path, PosixPath
from types import SimpleNamespace

import numpy
import torch
from numpy.core.multiarray import _reconstruct

from converters.mapping import ConversionError
from plugins.core.checkpoint import load_error


class _StandIn(enum.Enum):
    """Base of inert stand-ins for the enums Megatron pickles into `args`."""

    @classmethod
    def _missing_(cls, value):  # any member value loads; the enum's name is what args keep
        member = object.__new__(cls)
        member._name_, member._value_ = f"value_{value}", value
        return member


# Megatron's own classes found in args pickles (BigCode's fork: megatron.model.enums, 2022:
# megatron.enums), mapped to inert stand-ins with the same member values; nothing else is allowed.
_ENUMS = {
    "PositionEmbeddingType": {"rotary": 1, "absolute": 2, "alibi": 3},
    "ModelType": {"encoder_or_decoder": 1, "encoder_and_decoder": 2, "retro_encoder": 3, "retro_decoder": 4},
    "AttnMaskType": {"padding": 1, "causal": 2, "prefix": 3, "custom": 4},
    "LayerType": {"encoder": 1, "decoder": 2, "retro_encoder": 3, "retro_decoder": 4,
                  "retro_decoder_with_retriever": 5},
    "AttnType": {"self_attn": 1, "cross_attn": 2},
}
STAND_INS = {name: _StandIn(name, members, module="megatron.model.enums", qualname=name)
             for name, members in _ENUMS.items()}
SAFE_GLOBALS = [(STAND_INS[name], f"{module}.{name}") for module in ("megatron.model.enums", "megatron.enums")
                for name in _ENUMS]


class GeneratorState:
    """Stands in for a pickled `torch.Generator`: Megatron-LM's graph-safe RNG tracker saves its states as
    generators in `rng_state` (megatron-core 0.19 allows `torch._C.Generator` for them). Allowed as itself,
    the weights-only unpickler would call `torch._C.Generator(device)` and `__setstate__((seed, offset,
    state))`: torch's own code, no code from the file, but a CUDA generator cannot be built on a CPU-only
    torch. The converters ignore RNG state, so the pickled values are only kept here."""

    def __init__(self, device=None):
        self.device, self.state = device, None

    def __setstate__(self, state):
        self.state = state


# The stdlib, numpy and torch part of megatron-core's own list (megatron.core.safe_globals.SAFE_GLOBALS,
# 0.19's included): its megatron classes are imported only for a file that names one (importing
# megatron.core takes seconds).
PLAIN_GLOBALS = [SimpleNamespace, PosixPath, _reconstruct, numpy.ndarray, numpy.dtype,
                 numpy.dtypes.UInt32DType, Namespace, BytesIO, signal.Signals,
                 (GeneratorState, "torch._C.Generator")]


def load_checkpoint_file(f: Path) -> dict:
    """One model_optim_rng.pt, mapped (not copied), through torch's weights-only unpickler: tensors,
    containers, argparse.Namespace, torch dtypes, numpy scalars (megatron-core's safe globals), and
    Megatron's enums and torch generators as inert stand-ins. Any other global is refused, whatever torch's environment
    (`weights_only=True` is explicit)."""
    try:
        if any(name.startswith("megatron.core.") for name in torch.serialization.get_unsafe_globals_in_checkpoint(f)):
            from megatron.core.safe_globals import register_safe_globals

            register_safe_globals()
        # Only what is not registered already: leaving the context removes what it added, and it must not
        # unregister what megatron-core (or the caller) registered for the whole process.
        registered = torch.serialization.get_safe_globals()
        with torch.serialization.safe_globals([g for g in SAFE_GLOBALS + PLAIN_GLOBALS if g not in registered]):
            ckpt = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise ConversionError(f"{f} is missing") from None
    except Exception as e:  # truncated zip, refused global, pickle errors: one message
        raise ConversionError(load_error(f, e)) from None
    if not isinstance(ckpt, dict) or "args" not in ckpt or not ({"model", "model0"} & set(ckpt)):
        raise ConversionError(f"{f}: not a Megatron-LM checkpoint (needs 'args' and 'model')")
    if "model0" in ckpt:
        raise ConversionError(f"{f}: virtual pipeline stages (model0, model1, ...) are not supported")
    if not isinstance(ckpt["args"], Namespace):
        raise ConversionError(f"{f}: 'args' is not an argparse.Namespace")
    return ckpt


def flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, path + "/"))
        elif v is not None and not path.endswith("_extra_state"):
            out[path] = v
    return out


def nest(flat: dict) -> dict:
    """{'a/b/c': T} -> {'a': {'b': {'c': T}}}."""
    out = {}
    for path, t in flat.items():
        *parents, leaf = path.split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = t
    return out

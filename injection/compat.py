"""Every patch of DeepSpeed 0.19.8 this project needs, in one place.

Each patch names the upstream function it works around and is checked by a test in
tests/unit/test_injection.py that fails if upstream changes. `apply()` is idempotent; the originals
are kept in `UPSTREAM` (tests call them to show the upstream behaviour is still there).
"""

from __future__ import annotations

import glob
import os
import sys
import time
import warnings
from contextlib import contextmanager

import deepspeed.module_inject.replace_module as ds_replace_module
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.comm.torch import TorchBackend
from deepspeed.module_inject import fusedqkv_utils
from deepspeed.module_inject.containers.opt import HFOPTLayerPolicy
from deepspeed.module_inject.policy import TransformerPolicy
from deepspeed.module_inject.replace_policy import replace_policies
from deepspeed.ops.transformer.inference.op_binding.base import BaseOp

UPSTREAM = {
    "replace_module.policy_to_ds_container": ds_replace_module.policy_to_ds_container,
    "HFOPTLayerPolicy.__init__": HFOPTLayerPolicy.__init__,
    "TorchBackend.__init__": TorchBackend.__init__,
}
_containers = {}  # our policy class -> our container class


# 1. deepspeed/module_inject/utils.py: policy_to_ds_container
#    A closed dict of DeepSpeed's own policies; any other policy gets None and injection fails.
#    replace_module.py imports it by name, so the name is rebound there.
def _policy_to_ds_container(**kwargs):
    container = _containers.get(type(kwargs["policy"]))
    if container is not None:
        return container(**kwargs)
    return UPSTREAM["replace_module.policy_to_ds_container"](**kwargs)


# 2. deepspeed/module_inject/containers/opt.py: HFOPTLayerPolicy.__init__
#    replace_module() instantiates every policy with client_module=None just to read its
#    _orig_layer_class; OPT's __init__ then validates TransformerPolicy.hf_model_config (the model
#    being injected) and raises "Unsupported activation function: gelu_pytorch_tanh" for
#    gpt_bigcode and starcoder2. Only that throw-away instance, for those models, is spared the check.
def _opt_policy_init(self, client_module, *args, **kwargs):
    config = TransformerPolicy.hf_model_config
    if client_module is None and getattr(config, "model_type", None) in ("gpt_bigcode", "starcoder2"):
        TransformerPolicy.hf_model_config = None
        try:
            return UPSTREAM["HFOPTLayerPolicy.__init__"](self, client_module, *args, **kwargs)
        finally:
            TransformerPolicy.hf_model_config = config
    return UPSTREAM["HFOPTLayerPolicy.__init__"](self, client_module, *args, **kwargs)


def apply(policy_cls, container_cls) -> None:
    """Register `policy_cls` -> `container_cls` with DeepSpeed's injection (idempotent)."""
    _containers[policy_cls] = container_cls
    if policy_cls not in replace_policies:
        replace_policies.append(policy_cls)  # the list replace_module() iterates
    ds_replace_module.policy_to_ds_container = _policy_to_ds_container
    HFOPTLayerPolicy.__init__ = _opt_policy_init
    patch_comm()


class _NoKernels:
    """An `inference_module` without kernels: every op binding takes its `*_fallback`."""


# 3. deepspeed/ops/transformer/inference/op_binding/base.py: BaseOp.__init__
#    loads InferenceBuilder, which on the CPU accelerator is NotImplementedBuilder whose load()
#    raises ValueError ("This op had not been implemented on CPU backend"), so no inference layer
#    can even be built on CPU although every binding has a pure-torch fallback. While our layer
#    is built on CPU, BaseOp sees a module without kernels (AttributeError -> fallback); the
#    previous value is restored after, so other models' injection is untouched.
def on_cpu() -> bool:
    return get_accelerator().device_name() == "cpu"


@contextmanager
def cpu_op_fallbacks():
    if not on_cpu():
        yield
        return
    saved = BaseOp.inference_module
    BaseOp.inference_module = _NoKernels()
    try:
        yield
    finally:
        BaseOp.inference_module = saved


# 3b. deepspeed/ops/transformer/inference/op_binding/workspace.py: WorkspaceOp.__init__
#    prints "Using fallback functions in workspace because of ..." (print(), not a warning) for each
#    layer built without kernels, i.e. every layer on CPU; the fallbacks it then picks are the ones
#    we want. While our layer is built, that one line is dropped; anything else printed passes.
@contextmanager
def quiet_workspace_fallback():
    if not on_cpu():
        yield
        return
    real = sys.stdout
    sys.stdout = _DropLines(real, "Using fallback functions in workspace")
    try:
        yield
    finally:
        sys.stdout = real


class _DropLines:
    """A stream that drops what print() writes for lines starting with `prefix` (the text, then its "\n")."""

    def __init__(self, stream, prefix: str):
        self.stream, self.prefix, self.dropping = stream, prefix, False

    def write(self, text: str) -> int:
        drop = text.startswith(self.prefix) or (self.dropping and text == "\n")
        self.dropping = text.startswith(self.prefix)
        return len(text) if drop else self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


# 4. deepspeed/module_inject/fusedqkv_utils.py: prepare_tp_fused_qkvw, 'bigcodetype'
#    FUSED_QKV_TYPE_DICT sends every GPTBigCodeBlock to _bigcode_type_transpose, which assumes the
#    MQA layout [Q (n_embd) | K | V] and replicates "kv"; an MHA c_attn (per head [q, k, v]) is then
#    cut into garbage. While AutoTP shards an MHA model, its c_attn is split as 'bloomtype'
#    (contiguous runs of whole heads, which is exactly per-head [q, k, v]).
@contextmanager
def mha_bigcode_qkv_as_bloom(enabled: bool):
    saved = fusedqkv_utils.FUSED_QKV_TYPE_DICT["GPTBigCodeBlock"]
    if enabled:
        fusedqkv_utils.FUSED_QKV_TYPE_DICT["GPTBigCodeBlock"] = "bloomtype"
    try:
        yield
    finally:
        fusedqkv_utils.FUSED_QKV_TYPE_DICT["GPTBigCodeBlock"] = saved


# 5. deepspeed/comm/torch.py: TorchBackend.__init__ -> ops/csrc/cpu/comm/shm.cpp: shm_initialize
#    With all ranks on one machine (LOCAL_SIZE == world size), each rank creates a POSIX
#    shared-memory segment for the CPU all-reduce (67 MB, /dev/shm/<shm_segment(rank)>) and never
#    unlinks it: every TP run leaves 67 MB per rank in /dev/shm (RAM) until reboot. Once every rank
#    has mapped every segment (a barrier after upstream's init), each rank unlinks its own name;
#    the mappings stay valid and the memory is freed when the last rank exits.
#    With ranks on several machines (LOCAL_SIZE < world size) upstream skips shm_initialize, yet
#    TorchBackend.inference_all_reduce (the MLP's all-reduce) still runs the shm kernel on segments
#    that were never made; a vector level of 0 sends it down upstream's own process-group path.
def shm_segment(rank: int) -> str:
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def _torch_backend_init(self, *args, **kwargs):
    UPSTREAM["TorchBackend.__init__"](self, *args, **kwargs)
    world = self.get_world_size()
    if world != int(os.environ.get("LOCAL_SIZE", 0) or 0):
        self.shm_vector_kernel_level = 0
    elif self.shm_comm_op is not None:
        torch.distributed.barrier()
        try:
            os.unlink(os.path.join("/dev/shm", shm_segment(self.get_rank())))
        except FileNotFoundError:  # initialised earlier in this process (upstream makes it once)
            pass


def mapped_shm_segments() -> set:
    """Names of this user's DeepSpeed all-reduce segments that a live process maps."""
    prefix = f"deepspeed_allreduce_buffer_{os.getuid()}_"
    mapped = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                mapped.update(line.rsplit("/", 1)[-1].strip() for line in f if "/dev/shm/" + prefix in line)
        except OSError:  # a process that ended, or another user's
            continue
    return mapped


def sweep_shm_segments(min_age_s: float = 60.0) -> list[str]:
    """Unlink this user's DeepSpeed all-reduce segments that no live process maps: what ranks killed
    before patch 5's unlink (e.g. during a TP load) left in /dev/shm. Segments younger than
    `min_age_s` are left alone (a run starting now may not have mapped them yet)."""
    prefix = f"deepspeed_allreduce_buffer_{os.getuid()}_"
    try:
        names = [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
    except OSError:
        return []
    if not names:
        return []
    mapped = mapped_shm_segments()
    removed = []
    for name in names:
        path = os.path.join("/dev/shm", name)
        try:
            if name not in mapped and time.time() - os.stat(path).st_mtime >= min_age_s:
                os.unlink(path)
                removed.append(name)
        except OSError:
            continue
    return removed


def patch_comm() -> None:
    """Patch 5 alone (AutoTP needs it without our injection policy); idempotent. It acts on the
    backend DeepSpeed creates next, so it must run before `deepspeed.init_distributed()`."""
    TorchBackend.__init__ = _torch_backend_init
    from deepspeed.comm import comm

    backend = comm.cdb
    if (isinstance(backend, TorchBackend) and backend.shm_comm_op is not None and backend.is_initialized()
            and os.path.exists(os.path.join("/dev/shm", shm_segment(backend.get_rank())))):
        warnings.warn("injection.register() / init_autotp() ran after deepspeed.init_distributed(): DeepSpeed's "
                      f"shared-memory all-reduce segment /dev/shm/{shm_segment(backend.get_rank())} will not be "
                      "unlinked when this run ends; call injection.register() first", stacklevel=3)

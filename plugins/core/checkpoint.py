"""Seeded checkpoints from configs, written and read as HF directories (config.json + safetensors).

HF's default init runs every module's `_init_weights` on a fully materialised model (~10 s for
1.1B parameters here). We build the module on the meta device, allocate it once with `to_empty`,
and fill every tensor in one seeded pass. Loading builds on meta too and assigns the safetensors
tensors directly, so no random init is ever paid for weights that are about to be overwritten.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

from .config import ConfigError

WEIGHTS_NAME = "model.safetensors"


def _init_tensor(name: str, tensor: torch.Tensor, config: GPTBigCodeConfig, gen: torch.Generator) -> None:
    """GPTBigCode's own init rule (`_init_weights`), applied to one named tensor."""
    if name.endswith("bias"):
        tensor.zero_()
    elif ".ln_" in name or name.startswith("transformer.ln_f"):
        tensor.fill_(1.0)
    else:
        std = config.initializer_range
        if name.endswith("c_proj.weight"):  # GPT-2 scheme: residual projections scaled by depth
            std = std / (2 * config.n_layer) ** 0.5
        tensor.normal_(0.0, std, generator=gen)


def _build_empty(config: GPTBigCodeConfig) -> GPTBigCodeForCausalLM:
    """The module tree with uninitialised storage: no init pass, no copy."""
    with torch.device("meta"):
        model = GPTBigCodeForCausalLM(config)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty allocates tied parameters separately
    n = config.n_positions  # the one (non-persistent) buffer: HF's causal-mask table
    model.transformer.bias.copy_(torch.tril(torch.ones((n, n), dtype=torch.bool)))
    return model


def init_model(config: GPTBigCodeConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> GPTBigCodeForCausalLM:
    """A GPTBigCodeForCausalLM with deterministic weights: same (config, seed) -> same bits."""
    model = _build_empty(config)
    # One generator per tensor, seeded by (seed, index): deterministic whatever the thread count,
    # and tensors fill in parallel (torch's CPU normal_ is single-threaded).
    params = list(model.named_parameters())  # tied parameters are listed once

    def fill(index: int) -> None:
        name, param = params[index]
        _init_tensor(name, param.data, config, torch.Generator().manual_seed(seed * 1_000_003 + index))

    with torch.no_grad(), ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        list(pool.map(fill, range(len(params))))
    model.to(dtype)
    model.eval()
    return model


@contextmanager
def atomic_dir(dst: Path, force: bool = False):
    """Yield a temp dir beside `dst`; on success it replaces `dst`, on error it is removed."""
    dst = Path(dst)
    if dst.exists() and not force:
        raise FileExistsError(f"{dst} already exists (pass force=True / --force to overwrite)")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dst.exists():
        shutil.rmtree(dst)
    os.replace(tmp, dst)


def save_hf_dir(model: GPTBigCodeForCausalLM, dst: str | Path, force: bool = False) -> Path:
    """Write `config.json` + `model.safetensors` that `from_pretrained` loads."""
    dst = Path(dst)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    with atomic_dir(dst, force=force) as tmp:
        model.config.save_pretrained(tmp)
        save_file(state, tmp / WEIGHTS_NAME, metadata={"format": "pt"})
    return dst


def create_checkpoint(config: GPTBigCodeConfig, dst: str | Path, seed: int = 0, dtype=torch.float32,
                      force: bool = False) -> Path:
    return save_hf_dir(init_model(config, seed=seed, dtype=dtype), dst, force=force)


def ensure_checkpoint(config: GPTBigCodeConfig, dst: str | Path, seed: int = 0) -> Path:
    """Reuse `dst` if it holds this config (same architecture), else (re)create it."""
    dst = Path(dst)
    if (dst / WEIGHTS_NAME).is_file() and (dst / "config.json").is_file():
        saved = json.loads((dst / "config.json").read_text())
        want = config.to_dict()
        keys = ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions", "multi_query", "n_inner")
        if all(saved.get(k) == want.get(k) for k in keys):
            return dst
    return create_checkpoint(config, dst, seed=seed, force=True)


def read_hf_config(src: str | Path) -> GPTBigCodeConfig:
    src = Path(src)
    cfg_file = src / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"{src} is not an HF model directory (no config.json)")
    model_type = json.loads(cfg_file.read_text()).get("model_type")
    if model_type != "gpt_bigcode":
        raise ConfigError(f"{src} holds a {model_type!r} model, not gpt_bigcode")
    return GPTBigCodeConfig.from_pretrained(src)


def read_hf_state(src: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory's `*.safetensors` files (the one reader: backends and converters)."""
    src = Path(src)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{src} has no *.safetensors weights")
    state = {}
    for f in files:
        try:
            state.update(load_file(f))
        except (SafetensorError, OSError, ValueError) as e:
            raise ConfigError(f"cannot read {f}: {e}") from None
    return state


def load_hf_model(src: str | Path, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa",
                  config: GPTBigCodeConfig | None = None) -> GPTBigCodeForCausalLM:
    """Load an HF gpt_bigcode directory without any random init (meta build + assign); `config`: the
    directory's config when the caller has read it already."""
    src = Path(src)
    config = config or read_hf_config(src)
    config._attn_implementation = attn_implementation
    state = read_hf_state(src)
    model = _build_empty(config)
    state = {k: v.to(dtype) for k, v in state.items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = set(model.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or extra:
        raise ConfigError(f"{src}: weights do not match the config (missing {missing[:5]}, unexpected {extra[:5]})")
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    model.to(dtype)
    model.eval()
    return model


def timed(fn, *args, **kwargs):
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t

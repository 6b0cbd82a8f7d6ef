"""Seeded checkpoints from configs, written and read as HF directories (config.json + safetensors,
with the tokenizer and generation files of plugins.core.hf_files).

HF's default init runs every module's `_init_weights` on a fully materialised model (~10 s for
1.1B parameters here). We build the module on the meta device, allocate it once with `to_empty`,
and fill every tensor in one seeded pass. Loading builds on meta too and assigns the safetensors
tensors directly, so no random init is ever paid for weights that are about to be overwritten.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import pickle
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import torch
from safetensors.torch import save_file
from transformers import GPTBigCodeConfig, Starcoder2Config

from plugins.core.arch import ARCHITECTURES, NAMES, arch, is_norm
from plugins.core.atomic import atomic_dir
from plugins.core.config import ConfigError, check_hf_config, hf_shapes
from plugins.core.hf_files import is_complete, write_companions
from plugins.core.tensors import FLOAT_DTYPES, dtype_name

if TYPE_CHECKING:
    from transformers import GPTBigCodeForCausalLM

WEIGHTS_NAME = "model.safetensors"
CONFIG_CLASSES = {"gpt_bigcode": GPTBigCodeConfig, "starcoder2": Starcoder2Config}


def _init_tensor(name: str, tensor: torch.Tensor, config, gen: torch.Generator) -> None:
    """The family's own init rule (`_init_weights`), applied to one named tensor: GPTBigCode's, or
    StarCoder2's (transformers' default: normal(initializer_range), zero biases, unit norms)."""
    if name.endswith("bias"):
        tensor.zero_()
    elif is_norm(name):
        tensor.fill_(1.0)
    else:
        std = config.initializer_range
        if arch(config).family == "gpt_bigcode" and name.endswith("c_proj.weight"):
            std = std / (2 * config.n_layer) ** 0.5  # GPT-2 scheme: residual projections scaled by depth
        tensor.normal_(0.0, std, generator=gen)


def model_class(config):
    """The HF causal-LM class of the config's family."""
    import transformers  # here: the modeling code is most of transformers' import time

    return getattr(transformers, ARCHITECTURES[arch(config).family])


def _build_empty(config) -> GPTBigCodeForCausalLM:
    """The module tree with uninitialised storage: no init pass, no copy."""
    with torch.device("meta"):
        model = model_class(config)(config)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty allocates tied parameters separately
    # the non-persistent buffers, which to_empty left uninitialised
    if arch(config).family == "starcoder2":  # RoPE's inverse frequencies: the module rebuilt on CPU
        model.model.rotary_emb = type(model.model.rotary_emb)(config)
    else:  # HF's causal-mask table
        n = config.n_positions
        model.transformer.bias.copy_(torch.tril(torch.ones((n, n), dtype=torch.bool)))
    return model


def init_model(config, seed: int = 0, dtype: torch.dtype = torch.float32) -> GPTBigCodeForCausalLM:
    """The config's causal LM (GPTBigCodeForCausalLM, Starcoder2ForCausalLM) with deterministic weights:
    same (config, seed) -> same bits."""
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


def save_hf_dir(model: GPTBigCodeForCausalLM, dst: str | Path, force: bool = False,
                tokenizer: str | Path | None = None, chat_template: str | None = None) -> Path:
    """Write a complete HF directory (`write_hf_files`) that `from_pretrained` loads, atomically."""
    dst = Path(dst)
    with atomic_dir(dst, force=force) as tmp:
        write_hf_files(model, tmp, tokenizer=tokenizer, chat_template=chat_template)
    return dst


def write_hf_files(model: GPTBigCodeForCausalLM, directory: Path, tokenizer: str | Path | None = None,
                   chat_template: str | None = None) -> None:
    """`config.json` + `model.safetensors` + the tokenizer and generation files (plugins.core.hf_files)
    into an existing directory (callers publish it atomically). `tokenizer`: a name in
    plugins.core.tokenizer.TOKENIZERS or a tokenizer.json path, default the project's."""
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model.config.architectures = [ARCHITECTURES[arch(model.config).family]]  # what save_pretrained records too
    write_companions(directory, model.config, tokenizer, chat_template)  # first: a vocab mismatch writes nothing
    model.config.save_pretrained(directory)
    save_file(state, Path(directory) / WEIGHTS_NAME, metadata={"format": "pt"})


def create_checkpoint(config: GPTBigCodeConfig, dst: str | Path, seed: int = 0, dtype=torch.float32,
                      force: bool = False, tokenizer: str | Path | None = None,
                      chat_template: str | None = None) -> Path:
    return save_hf_dir(init_model(config, seed=seed, dtype=dtype), dst, force=force, tokenizer=tokenizer,
                       chat_template=chat_template)


def ensure_checkpoint(config: GPTBigCodeConfig, dst: str | Path, seed: int = 0) -> Path:
    """Reuse `dst` if it holds this config (same architecture), else (re)create it. A directory written
    before checkpoints carried their tokenizer is made again (the same seeded weights)."""
    dst = Path(dst)
    if (dst / WEIGHTS_NAME).is_file() and is_complete(dst):
        try:
            saved = json.loads((dst / "config.json").read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            saved = {}
        want = config.to_dict()
        fam = arch(config).family
        keys = ("model_type", "num_key_value_heads", "rope_parameters", "sliding_window", "tie_word_embeddings",
                *NAMES[fam].values()) if fam == "starcoder2" else (
            "n_layer", "n_embd", "n_head", "vocab_size", "n_positions", "multi_query", "n_inner")
        if all(saved.get(k) == want.get(k) for k in keys):
            return dst
    return create_checkpoint(config, dst, seed=seed, force=True)


def read_hf_config(src: str | Path) -> GPTBigCodeConfig:
    """The config of an HF gpt_bigcode or starcoder2 directory, its architecture checked (check_hf_config)."""
    src = Path(src)
    cfg_file = src / "config.json"
    if not cfg_file.is_file():
        hint = ""
        if not src.exists() and len(Path(str(src)).parts) == 2 and not str(src).startswith((".", "/", "~")):
            hint = ("; it looks like a hub id: nothing is downloaded here, point to a local directory "
                    "(e.g. one made by scripts/make_checkpoint.py or scripts/convert.py)")
        raise ConfigError(f"{src} is not an HF model directory (no config.json){hint}")
    try:
        raw = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
        raise ConfigError(f"{cfg_file}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{cfg_file}: expected a JSON object")
    kind = raw.get("model_type")
    if kind not in CONFIG_CLASSES:
        raise ConfigError(f"{src} holds a {kind!r} model, not {' or '.join(CONFIG_CLASSES)}")
    try:
        config = CONFIG_CLASSES[kind].from_dict(raw)
    except Exception as e:  # transformers' own field validation (type errors, strict dataclass checks)
        raise ConfigError(f"{cfg_file}: not a valid {kind} config ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200]})") from None
    check_hf_config(config, str(cfg_file))
    return config


def _weight_files(src: Path) -> list[Path]:
    """The weight files of an HF directory: sharded or single safetensors, else pytorch_model*.bin."""
    for index, pattern in (("model.safetensors.index.json", "*.safetensors"),
                           ("pytorch_model.bin.index.json", "pytorch_model*.bin")):
        if (src / index).is_file():
            try:
                weight_map = json.loads((src / index).read_text())["weight_map"]
                names = sorted(set(weight_map.values()))
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
                raise ConfigError(f"{src / index}: not a weight index ({type(e).__name__}: {e})") from None
            files = [src / n for n in names]
            missing = [f.name for f in files if not f.is_file() or f.parent != src]
            if missing:
                raise ConfigError(f"{src}: shard(s) {', '.join(missing[:3])} named in {index} are missing")
            return files
        files = sorted(src.glob(pattern))
        if files:
            return files
    raise ConfigError(f"{src} has no weights (*.safetensors or pytorch_model*.bin)")


def load_error(f: Path, e: BaseException) -> str:
    """One line for a file torch.load (weights-only) or safetensors could not read."""
    refused = re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) (\S+)", str(e))
    if refused:
        return (f"{f}: refusing to load {refused.group(1)} (no code from a checkpoint runs: only tensors, "
                "plain containers and known argument types load)")
    return f"cannot read {f}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}
MAX_HEADER = 100 << 20  # what the safetensors library itself accepts


def read_safetensors(f: Path) -> dict[str, torch.Tensor]:
    """A safetensors file as tensors mapped from it (private, copy-on-write): nothing is copied or
    allocated until a tensor is written or cast, so reading a checkpoint costs page cache, not memory.
    The header is checked as the safetensors library checks it (sizes, offsets within the file)."""
    with open(f, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError("file shorter than a safetensors header")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER or 8 + n > size:
            raise ValueError(f"header of {n} bytes does not fit the file ({size} bytes)")
        header = json.loads(fh.read(n))
        data = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY) if size > 8 + n else None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    out, start = {}, 8 + n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(info.get("dtype")) if isinstance(info, dict) else None
        shape, offsets = (info.get("shape"), info.get("data_offsets")) if dtype is not None else (None, None)
        if (dtype is None or not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)
                or not isinstance(offsets, list) or len(offsets) != 2):
            raise ValueError(f"tensor {name!r}: malformed header entry {str(info)[:100]}")
        begin, end = offsets
        nbytes = math.prod(shape) * dtype.itemsize
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end and start + end <= size
                and end - begin == nbytes):
            raise ValueError(f"tensor {name!r}: data {offsets} does not match its shape {shape} or the file")
        t = (torch.frombuffer(data, dtype=dtype, count=nbytes // dtype.itemsize, offset=start + begin)
             if nbytes else torch.empty(0, dtype=dtype))
        out[name] = t.view(shape)
    return out


def _read_file(f: Path) -> dict[str, torch.Tensor]:
    try:
        if f.suffix == ".safetensors":
            return read_safetensors(f)
        # no code from the file runs: torch's restricted unpickler (tensors and plain containers only)
        state = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
    except (OSError, ValueError, RuntimeError, pickle.UnpicklingError, EOFError) as e:
        raise ConfigError(load_error(f, e)) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"{f}: not a state dict of tensors")
    return state


def _header_shapes(f: Path) -> dict[str, tuple]:
    """Tensor names and shapes of a weight file; the tensors are mapped, nothing is read or copied."""
    return {k: tuple(v.shape) for k, v in _read_file(f).items()}


def check_weight_shapes(src: Path, config: GPTBigCodeConfig) -> None:
    """Names and shapes of every stored tensor against the config, before any weight is allocated."""
    want = hf_shapes(config)
    got, where = {}, {}
    for f in _weight_files(src):
        for k, shape in _header_shapes(f).items():
            if k in got:
                raise ConfigError(f"{src}: tensor {k} is stored twice ({where[k]} and {f.name})")
            got[k], where[k] = shape, f.name
    if config.tie_word_embeddings:
        got.pop("lm_head.weight", None)  # some writers store the tied head too
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or extra:
        raise ConfigError(f"{src}: weights do not match config.json (missing {missing[:3]}, unexpected {extra[:3]})")
    for k, shape in want.items():
        if got[k] != shape:
            raise ConfigError(f"{src}: {k} has shape {got[k]}, config.json says {shape}")


def read_hf_state(src: str | Path, config: GPTBigCodeConfig | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory (the one reader: backends and converters). Sharded or single
    safetensors, or pytorch_model*.bin read weights-only. With `config`, names and shapes are checked
    against it from the files' headers before any tensor is read. A tied `lm_head.weight` is dropped."""
    src = Path(src)
    if config is not None:
        check_weight_shapes(src, config)
    state = {}
    for f in _weight_files(src):
        part = _read_file(f)
        dup = sorted(set(part) & set(state))
        if dup:
            raise ConfigError(f"{src}: tensor {dup[0]} is stored in more than one file")
        state.update(part)
    bad = sorted(k for k, v in state.items() if v.dtype not in FLOAT_DTYPES)
    if bad:
        raise ConfigError(f"{src}: {bad[0]} is {state[bad[0]].dtype}; model weights are floating point")
    if config is not None and config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def check_memory(config: GPTBigCodeConfig, dtype: torch.dtype, what: str) -> None:
    """Refuse to build a model that cannot fit in this machine's available memory."""
    need = sum(math.prod(s) for s in hf_shapes(config).values()) * torch.empty((), dtype=dtype).element_size()
    free = psutil.virtual_memory().available
    if need > free:
        raise ConfigError(f"{what}: the model needs {need / 2**30:.1f} GiB in {dtype_name(dtype)}, "
                          f"{free / 2**30:.1f} GiB of memory is available")


def load_hf_model(src: str | Path, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa",
                  config: GPTBigCodeConfig | None = None) -> GPTBigCodeForCausalLM:
    """Load an HF gpt_bigcode directory without any random init (meta build + assign); `config`: the
    directory's config when the caller has read it already. Names, shapes and memory are checked
    before anything is allocated."""
    src = Path(src)
    config = config or read_hf_config(src)
    config._attn_implementation = attn_implementation
    check_weight_shapes(src, config)
    check_memory(config, dtype, str(src))
    # copies in memory (the files are only mapped while reading): a running model never depends on them
    state = {k: v.to(dtype, copy=True) for k, v in read_hf_state(src, config).items()}
    model = _build_empty(config)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    model.to(dtype)
    model.eval()
    return model

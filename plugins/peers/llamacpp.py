"""llama.cpp, the engine a team would try for a small code model on a CPU, behind the Backend protocol.

`make peers` builds libllama (scripts/build_llamacpp.sh) from the pinned llama-cpp-python sdist, whose
ctypes bindings are used from the unpacked sdist. Our HF checkpoint is converted once by llama.cpp's own
`convert_hf_to_gguf.py` (its gpt_bigcode converter writes one KV head: MQA only) into
`<checkpoint>.gguf-<weights>/model.gguf` beside it (atomic); q4 types are then quantized by libllama.
A batch decodes as one: every row is its own sequence of one llama_batch (left padding stripped, each
prompt at positions 0..n-1), then one token per row per llama_decode. Greedy only (argmax here).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from plugins.core.atomic import atomic_dir
from plugins.core.checkpoint import read_hf_config
from plugins.core.config import REPO_ROOT, ConfigError
from plugins.core.tensors import check_load
from plugins.engine.backend import LocalBackend
from plugins.engine.contract import GenerationResult
from plugins.peers import in_own_process, staged_checkpoint

# weights -> (converter --outtype, libllama ftype to quantize to after it or None)
WEIGHTS = {"f32": ("f32", None), "f16": ("f16", None), "bf16": ("bf16", None), "q8_0": ("q8_0", None),
           "q4_0": ("f32", "LLAMA_FTYPE_MOSTLY_Q4_0"), "q4_K_M": ("f32", "LLAMA_FTYPE_MOSTLY_Q4_K_M")}
FROM_DTYPE = {"float32": "f32", "fp32": "f32", "bfloat16": "bf16", "bf16": "bf16", "float16": "f16", "fp16": "f16"}
MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ: one sequence per row
CTX_PAD = 256  # llama.cpp rounds each sequence's context up to this

# Runs convert_hf_to_gguf.py (argv: llama.cpp dir, then its own arguments). The converter names the
# pre-tokenizer by a hash of how the tokenizer splits a fixed text, from a table of known tokenizers;
# ours (trained here, with the byte-level GPT-2 split and no digit split) is not in it, and an unknown
# hash is an error. "gpt-2" is the entry whose split ours is ("starcoder" would split digits).
CONVERT = """import runpy, sys
ll = sys.argv.pop(1)
sys.path[:0] = [ll, ll + "/gguf-py"]
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv[0] = ll + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def build_dir() -> Path:
    """Where `make peers` put llama.cpp (PLUGINS_LLAMACPP_DIR overrides)."""
    return Path(os.environ.get("PLUGINS_LLAMACPP_DIR") or REPO_ROOT / ".cache" / "peers" / "llama.cpp")


def _bindings():
    """The llama_cpp module of the build; ImportError when the build is absent."""
    root = build_dir()
    if not (root / "BUILT").is_file():
        raise ImportError(f"llama.cpp is not built in {root}: run `make peers`")
    if "llama_cpp" not in sys.modules:
        os.environ["LLAMA_CPP_LIB_PATH"] = str(root / "lib")
        sys.path.insert(0, str(root / "src"))
    import llama_cpp

    if Path(llama_cpp.__file__).resolve().parent.parent != (root / "src").resolve():
        raise ImportError(f"llama_cpp was already imported from {llama_cpp.__file__}, not from {root}")
    # their log callback prints whatever the 'llama-cpp-python' logger's level lets through: errors only
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    return llama_cpp


# At import, so that without `make peers` the module does not import and the bench lists the backend
# as skipped, with this error as the reason.
llama_cpp = _bindings()


def weights_name(weights: str | None, dtype) -> str:
    if weights is None:
        name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
        if name not in FROM_DTYPE:
            raise ConfigError(f"unknown dtype {name!r}; use float32, bfloat16 or float16")
        return FROM_DTYPE[name]
    if weights not in WEIGHTS:
        raise ConfigError(f"unknown weights {weights!r}; use one of {', '.join(WEIGHTS)}")
    return weights


def converted_file(hf_dir: Path, weights: str) -> Path:
    hf_dir = Path(hf_dir).resolve()
    return hf_dir.parent / f"{hf_dir.name}.gguf-{weights}" / "model.gguf"


def convert(hf_dir: Path, weights: str, threads: int) -> Path:
    """llama.cpp's converter (and quantizer) on our checkpoint, cached: a second call only checks the file."""
    dst = converted_file(hf_dir, weights)
    if dst.is_file():
        return dst
    outtype, ftype = WEIGHTS[weights]
    with atomic_dir(dst.parent) as tmp, staged_checkpoint(hf_dir, tmp) as staged:
        out = tmp / ("model.gguf" if ftype is None else "f32.gguf")
        proc = subprocess.run([sys.executable, "-c", CONVERT, str(build_dir() / "src" / "vendor" / "llama.cpp"),
                               str(staged), "--outfile", str(out), "--outtype", outtype],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{proc.stderr[-3000:]}")
        if ftype is not None:
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype, params.nthread = getattr(llama_cpp, ftype), threads
            if llama_cpp.llama_model_quantize(str(out).encode(), str(tmp / "model.gguf").encode(), params) != 0:
                raise RuntimeError(f"llama.cpp could not quantize {out} to {weights}")
            out.unlink()
    return dst


class LlamaCppBackend(LocalBackend):
    name = "llama.cpp"

    def __init__(self, model, config, weights: str, threads: int):
        self.model, self.config, self.weights = model, config, weights
        # quantized weights meet float32 activations
        self.dtype = {"f16": torch.float16, "bf16": torch.bfloat16}.get(weights, torch.float32)
        self.device, self.tp_size, self.threads = "cpu", 1, threads
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        self._ctx, self._ctx_shape = None, None

    @classmethod
    def check_options(cls, config, tp_size: int, **options) -> None:
        super().check_options(config, tp_size, **options)
        if getattr(config, "model_type", None) != "gpt_bigcode":
            raise ConfigError(f"this peer is benchmarked on gpt_bigcode checkpoints, not {config.model_type}")
        if not config.multi_query:
            raise ConfigError("llama.cpp's gpt_bigcode (starcoder) converter supports multi-query attention only "
                              "(it writes one KV head)")
        if options.get("weights") is not None:
            weights_name(options["weights"], None)

    @classmethod
    def from_hf(cls, hf_dir: str | Path, dtype="float32", tp_size: int = 1, weights: str | None = None,
                threads: int | None = None):
        """`weights` (f32, f16, bf16, q8_0, q4_0, q4_K_M) overrides `dtype`; each is its own GGUF file."""
        config = read_hf_config(hf_dir)
        check_load(config, tp_size, max_tp=1)
        cls.check_options(config, tp_size, weights=weights)
        weights = weights_name(weights, dtype)
        remote = in_own_process(cls, hf_dir, dtype, {"weights": weights, "threads": threads})
        if remote is not None:
            return remote
        threads = threads or torch.get_num_threads()
        path = convert(Path(hf_dir), weights, threads)
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
        if not model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        return cls(model, config, weights, threads)

    def linear_paths(self, batch: int, prompt_len: int) -> dict:
        path = f"llama.cpp {self.weights}"
        return {"decode": path, "prefill": path}

    def _context(self, sequences: int, length: int):
        """A context for `sequences` rows of up to `length` tokens, its KV cache emptied; kept for the
        next call of the same shape (making one allocates the KV cache and plans the graph)."""
        per_seq = -(-length // CTX_PAD) * CTX_PAD
        shape = (sequences, per_seq)
        if self._ctx_shape != shape:
            self._free_context()
            params = llama_cpp.llama_context_default_params()
            params.n_ctx, params.n_seq_max = sequences * per_seq, sequences
            params.n_batch = sequences * per_seq  # any prefill that fits the context in one llama_decode
            params.n_threads = params.n_threads_batch = self.threads
            params.kv_unified = False  # one KV stream per row: attention reads only its own cells
            # F32 cache for F32 weights (the exact comparison); llama.cpp's default F16 otherwise
            kv = llama_cpp.GGML_TYPE_F32 if self.weights == "f32" else llama_cpp.GGML_TYPE_F16
            params.type_k = params.type_v = kv
            self._ctx = llama_cpp.llama_init_from_model(self.model, params)
            if not self._ctx:
                raise RuntimeError(f"llama.cpp could not make a context of {sequences} x {per_seq} tokens")
            self._ctx_shape = shape
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self._ctx), True)
        return self._ctx

    def _free_context(self) -> None:
        if self._ctx:
            llama_cpp.llama_free(self._ctx)
        self._ctx, self._ctx_shape = None, None

    def _decode(self, ctx, rows: list[list[int]], start: list[int], outputs: str):
        """One llama_decode of `rows[b]` (sequence b, from position start[b]); logits [n_out, vocab] of every
        token (outputs='all') or of each row's last one ('last')."""
        import numpy as np

        total = sum(len(r) for r in rows)
        batch = llama_cpp.llama_batch_init(total, 0, 1)
        try:
            k = 0
            for b, row in enumerate(rows):
                for j, token in enumerate(row):
                    batch.token[k], batch.pos[k], batch.n_seq_id[k] = token, start[b] + j, 1
                    batch.seq_id[k][0] = b
                    batch.logits[k] = outputs == "all" or j == len(row) - 1
                    k += 1
            batch.n_tokens = total
            code = llama_cpp.llama_decode(ctx, batch)
            if code != 0:
                raise RuntimeError(f"llama_decode failed ({code})")
        finally:
            llama_cpp.llama_batch_free(batch)
        n_out = total if outputs == "all" else len(rows)
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(ctx), shape=(n_out, self.n_vocab))
        return logits[:, :self.config.vocab_size]

    @staticmethod
    def _rows(input_ids, attention_mask) -> list[list[int]]:
        return [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask)]

    def _check_batch(self, batch: int) -> None:
        if batch > MAX_SEQUENCES:
            raise ConfigError(f"llama.cpp decodes at most {MAX_SEQUENCES} sequences at once, got batch {batch}")

    def logits(self, input_ids, attention_mask):
        """[B, T, V], each row's logits at its own (left-padded) positions; padded positions are 0."""
        input_ids, attention_mask = self._prepare(input_ids, attention_mask)
        self._check_batch(input_ids.shape[0])
        rows = self._rows(input_ids, attention_mask)
        ctx = self._context(len(rows), input_ids.shape[1])
        out = torch.from_numpy(self._decode(ctx, rows, [0] * len(rows), "all").copy())
        full = torch.zeros((*input_ids.shape, out.shape[-1]))
        k = 0
        for b, row in enumerate(rows):
            full[b, input_ids.shape[1] - len(row):] = out[k:k + len(row)]
            k += len(row)
        return full

    def generate(self, input_ids, attention_mask, max_new_tokens, do_sample=False, temperature=1.0, top_k=0,
                 top_p=1.0, seed=0) -> GenerationResult:
        if do_sample:
            raise ConfigError("the llama.cpp backend decodes greedily only (do_sample=False)")
        input_ids, attention_mask = self._prepare(input_ids, attention_mask, max_new_tokens)
        batch = input_ids.shape[0]
        self._check_batch(batch)
        if max_new_tokens == 0:
            return GenerationResult(tokens=input_ids.clone(), prefill_s=0.0)
        rows = self._rows(input_ids, attention_mask)
        ctx = self._context(batch, input_ids.shape[1] + max_new_tokens)
        pos = [len(r) for r in rows]
        start = time.perf_counter()
        new = [self._decode(ctx, rows, [0] * batch, "last").argmax(-1).tolist()]
        times = [start, time.perf_counter()]
        for _ in range(max_new_tokens - 1):
            new.append(self._decode(ctx, [[t] for t in new[-1]], pos, "last").argmax(-1).tolist())
            pos = [p + 1 for p in pos]
            times.append(time.perf_counter())
        tokens = torch.tensor(new, dtype=torch.long).T
        return GenerationResult(tokens=torch.cat([input_ids, tokens], dim=1), prefill_s=times[1] - times[0],
                                step_s=[b - a for a, b in zip(times[1:], times[2:])])

    def close(self) -> None:
        self._free_context()
        if self.model:
            llama_cpp.llama_model_free(self.model)
        self.model = None

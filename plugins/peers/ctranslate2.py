"""CTranslate2, the engine a team would try first for SantaCoder on CPU, behind the Backend protocol.

Our HF checkpoint is converted by CTranslate2's own converter (`TransformersConverter`, whose
gpt_bigcode loader knows MQA only) once, into `<checkpoint>.ct2-<weights>/` beside it (atomic), and
loaded as a `ctranslate2.Generator`. Compute types on x86 CPUs: float32 and int8 (int8 weights,
float32 activations); bf16 and fp16 exist on CUDA only. CTranslate2 takes ragged batches, not
padding: left padding is stripped before a call and put back on the way out. Greedy only: its
sampler cannot be seeded from Python.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from plugins.core.atomic import atomic_dir
from plugins.core.checkpoint import read_hf_config
from plugins.core.config import ConfigError
from plugins.core.tensors import check_load
from plugins.engine.backend import LocalBackend
from plugins.engine.contract import GenerationResult
from plugins.peers import in_own_process, staged_checkpoint

COMPUTE_TYPES = {"float32": "float32", "fp32": "float32", "int8": "int8_float32", "int8_float32": "int8_float32",
                 "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "int8_bfloat16": "int8_bfloat16"}


def converted_dir(hf_dir: Path, weights: str) -> Path:
    hf_dir = Path(hf_dir).resolve()
    return hf_dir.parent / f"{hf_dir.name}.ct2-{weights}"


def convert(hf_dir: Path, weights: str = "float32") -> Path:
    """CTranslate2's converter on our checkpoint (cached: a second call only checks the directory)."""
    dst = converted_dir(hf_dir, weights)
    if (dst / "model.bin").is_file():
        return dst
    from ctranslate2.converters import TransformersConverter

    with atomic_dir(dst) as tmp, staged_checkpoint(hf_dir, tmp) as staged:
        TransformersConverter(str(staged)).convert(str(tmp / "model"), quantization=weights, force=True)
        for f in (tmp / "model").iterdir():
            f.rename(tmp / f.name)
        (tmp / "model").rmdir()
    return dst


class CTranslate2Backend(LocalBackend):
    name = "ctranslate2"

    def __init__(self, generator, config, compute_type: str, vocabulary: list[str], threads: int):
        self.generator, self.config, self.compute_type = generator, config, compute_type
        self.vocabulary = vocabulary  # id -> token string: generate_batch takes tokens as strings
        self.dtype = torch.float32 if compute_type == "float32" else torch.bfloat16 if "bfloat16" in compute_type \
            else torch.float16 if "float16" in compute_type else torch.float32
        self.device, self.tp_size, self.threads = "cpu", 1, threads

    @classmethod
    def check_options(cls, config, tp_size: int, **options) -> None:
        super().check_options(config, tp_size, **options)
        if getattr(config, "model_type", None) != "gpt_bigcode":
            raise ConfigError(f"this peer is benchmarked on gpt_bigcode checkpoints, not {config.model_type}")
        if not config.multi_query:
            raise ConfigError("CTranslate2's gpt_bigcode converter supports multi-query attention only "
                              "(multi_query: false checkpoints do not convert)")
        compute = options.get("compute_type")
        if compute is not None and compute not in COMPUTE_TYPES:
            raise ConfigError(f"unknown compute_type {compute!r}; use one of {', '.join(COMPUTE_TYPES)}")

    @classmethod
    def from_hf(cls, hf_dir: str | Path, dtype="float32", tp_size: int = 1, compute_type: str | None = None,
                threads: int | None = None):
        """`compute_type` (float32, int8, ... on CUDA bfloat16) overrides `dtype`; weights are converted
        in float32 and quantized at load time."""
        config = read_hf_config(hf_dir)
        check_load(config, tp_size, max_tp=1)
        cls.check_options(config, tp_size, compute_type=compute_type)
        remote = in_own_process(cls, hf_dir, dtype, {"compute_type": compute_type, "threads": threads})
        if remote is not None:
            return remote
        compute = COMPUTE_TYPES[compute_type or (dtype if isinstance(dtype, str) else str(dtype).split(".")[-1])]
        import ctranslate2

        device = "cuda" if ctranslate2.get_cuda_device_count() > 0 else "cpu"
        supported = ctranslate2.get_supported_compute_types(device)
        if compute not in supported:
            raise ConfigError(f"CTranslate2 cannot compute in {compute} on this {device} "
                              f"(supported: {', '.join(sorted(supported))}); pass compute_type")
        model_dir = convert(Path(hf_dir), "float32")
        threads = threads or torch.get_num_threads()
        generator = ctranslate2.Generator(str(model_dir), device=device, compute_type=compute,
                                          intra_threads=threads, inter_threads=1)
        vocabulary = json.loads((model_dir / "vocabulary.json").read_text())
        backend = cls(generator, config, compute, vocabulary, threads)
        backend.device = device
        return backend

    def linear_paths(self, batch: int, prompt_len: int) -> dict:
        path = f"ctranslate2 {self.compute_type}"
        return {"decode": path, "prefill": path}

    @staticmethod
    def _rows(input_ids, attention_mask) -> list[list[int]]:
        return [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask)]

    def logits(self, input_ids, attention_mask):
        """[B, T, V], each row's logits at its own (left-padded) positions; padded positions are 0."""
        import numpy as np

        input_ids, attention_mask = self._prepare(input_ids, attention_mask)
        rows = self._rows(input_ids, attention_mask)
        out = torch.from_numpy(np.array(self.generator.forward_batch(rows))).float()
        full = torch.zeros((*input_ids.shape, out.shape[-1]))
        for b, row in enumerate(rows):
            full[b, input_ids.shape[1] - len(row):] = out[b, :len(row)]
        return full[..., :self.config.vocab_size]

    def generate(self, input_ids, attention_mask, max_new_tokens, do_sample=False, temperature=1.0, top_k=0,
                 top_p=1.0, seed=0) -> GenerationResult:
        if do_sample:
            # its sampler draws from per-thread generators that set_random_seed does not reach: the same
            # seed gives different tokens, so a seeded run could not be reproduced
            raise ConfigError("the ctranslate2 backend decodes greedily only (do_sample=False)")
        input_ids, attention_mask = self._prepare(input_ids, attention_mask, max_new_tokens)
        batch = input_ids.shape[0]
        if max_new_tokens == 0:
            return GenerationResult(tokens=input_ids.clone(), prefill_s=0.0)
        rows = [[self.vocabulary[i] for i in row] for row in self._rows(input_ids, attention_mask)]
        stamps = []

        def step(result) -> bool:  # called per generated token of each row, in the decoding loop
            if result.batch_id == 0:
                stamps.append(time.perf_counter())
            return False

        start = time.perf_counter()
        results = self.generator.generate_batch(rows, max_length=max_new_tokens, include_prompt_in_result=False,
                                                end_token=[], beam_size=1, sampling_topk=1, callback=step)
        new = torch.tensor([r.sequences_ids[0] for r in results], dtype=torch.long).view(batch, max_new_tokens)
        times = [start] + stamps
        return GenerationResult(tokens=torch.cat([input_ids, new], dim=1), prefill_s=times[1] - times[0],
                                step_s=[b - a for a, b in zip(times[1:], times[2:])][:max_new_tokens - 1])

    def close(self) -> None:
        self.generator = None

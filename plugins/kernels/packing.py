"""Weights packed once for the GEMMs that want their own layout: our tiled bf16 / int8 GEMMs and
oneDNN's reordered bf16 weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Our bf16 GEMM on weights packed by pack_tiles (the others take the weight as stored)
TILED = ("avx512", "avx512f")
TILE_COLS = 64  # output columns per packed tile of our bf16 GEMM
# The rows oneDNN lays a packed weight out for. On an AMX Xeon (2 threads, santacoder-1b's linears) a pack
# for 64 rows ran prompts of 256-2048 rows 1.2-1.6x faster than one for 1 row and 1-32 rows as fast;
# without AMX (AVX512-BF16) the hint changed nothing (measured 2026-12-07)
ONEDNN_BATCH_HINT = 64


def pack_tiles(weight: torch.Tensor) -> torch.Tensor:
    """bf16 or int8 [N, K] -> [ceil(N / 64), ceil(K / 2), 64, 2], zero-padded: per tile of 64 output columns,
    each pair of consecutive inputs is 64 columns x 2 values (vdpbf16ps's operand layout, and vpmaddwd's
    once int8 is widened), one stream per tile."""
    n, k = weight.shape
    tiles, pairs = -(-n // TILE_COLS), -(-k // 2)
    padded = F.pad(weight, (0, 2 * pairs - k, 0, tiles * TILE_COLS - n))
    return padded.view(tiles, TILE_COLS, pairs, 2).transpose(1, 2).contiguous()


class PackedWeights:
    """Packed copies of weights ([out, in]) for our GEMMs ('avx512', 'avx512f': the same pack, bf16 or
    int8) or oneDNN's ('onednn', bf16), made on first use, kept per weight storage."""

    def __init__(self):
        self.packed = {}

    def get(self, weight: torch.Tensor, impl: str = "onednn") -> torch.Tensor:
        key = (weight.data_ptr(), tuple(weight.shape), "tiles" if impl in TILED else impl)
        entry = self.packed.get(key)
        if entry is None:
            if impl in TILED:
                pack = pack_tiles(weight)
            else:
                pack = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), ONEDNN_BATCH_HINT)
            # the weight is kept with its pack: its storage (the key) cannot be freed and reused
            entry = (weight, pack)
            self.packed[key] = entry
        return entry[1]

    def prepack(self, weight: torch.Tensor, impls) -> None:
        """Make now the packs `impls` (names as Probe.bf16 gives them) would make on first use."""
        for impl in impls:
            if impl in TILED or impl == "onednn":
                self.get(weight, impl)

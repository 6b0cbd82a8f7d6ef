"""RoPE at the positions HF uses, for megatron-core's GPTModel (StarCoder2).

megatron-core 0.16.1 rotates query and key by their column in the sequence (`arange(seq) + offset`, one
table for the whole batch), and in static-batch inference re-rotates the cached keys [0, t) every step.
HF rotates by `position_ids`, which skip left padding. The scores only depend on the distance between
two tokens, so both are the same model, but not the same numbers: a row that starts at column 300 of a
padded batch or of the serving pool is rotated by angles 300 positions larger than alone, and fp32 sin /
cos of those angles round differently (about 1e-5 rad per thousand positions). `PositionedRotary` takes
megatron's place (`GPTModel.rotary_pos_emb`) and returns, for every column of every row, the frequencies
of that row's own position ([columns, batch, 1, dim]: megatron's [columns, 1, 1, dim] with the batch
axis filled, which its `apply_rotary_pos_emb` broadcasts as is), computed exactly as HF computes them
(`position * inv_freq` in fp32, then `cat(freqs, freqs)`), so q and k are rotated bit for bit as in HF.
The caller states the positions of the next forward with `set_columns` (from the 2-D attention mask).
"""

from __future__ import annotations

import torch

from plugins.core.tensors import position_ids


def hf_inv_freq(config) -> torch.Tensor:
    """The inverse frequencies HF's own rotary embedding of this config uses (fp32)."""
    from transformers.models.starcoder2.modeling_starcoder2 import Starcoder2RotaryEmbedding

    inv_freq, _ = Starcoder2RotaryEmbedding.compute_default_rope_parameters(config)
    return inv_freq.float()


class PositionedRotary(torch.nn.Module):
    def __init__(self, inner, inv_freq: torch.Tensor):
        super().__init__()
        self.inner = inner  # megatron's RotaryEmbedding (its get_rotary_seq_len)
        self.inv_freq = inv_freq  # HF's (hf_inv_freq): a plain attribute, as megatron keeps its own
        self.columns: torch.Tensor | None = None

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        return self.inner.get_rotary_seq_len(*args, **kwargs)

    def set_columns(self, attention_mask: torch.Tensor) -> None:
        """The next forward's rows: the 2-D mask of every column it reads (cache and new tokens)."""
        self.columns = position_ids(attention_mask)  # each column's position in its row (padding: 0)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None) -> torch.Tensor:
        if self.columns is None or packed_seq or offset:
            raise RuntimeError("PositionedRotary needs the row positions of the forward (set_columns)")
        b, s = self.columns.shape
        if s > max_seq_len:
            raise RuntimeError(f"{s} columns of positions for a rotary table of {max_seq_len}")
        # [b, s, dim / 2], as HF's rotary embedding computes them
        freqs = self.columns[..., None].float() * self.inv_freq.to(self.columns.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.transpose(0, 1)[:, :, None, :]  # [s, b, 1, dim]

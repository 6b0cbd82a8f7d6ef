"""megatron-torch output at TP=2 x PP=2 loaded the way Megatron-LM loads it, in two real TP ranks (torchrun,
gloo): each rank's two stage files into that rank's GPTModel stages with load_state_dict(strict=True), the stages
chained, the logits against HF (fp32)."""

import os
from pathlib import Path

import pytest

from converters import convert
from plugins.launch.launcher import RemoteBackend
from plugins.hf import HFBackend

TOL = 1e-5


@pytest.mark.parametrize("name", ["tiny", "tiny-mha"])
def test_tp2_pp2_rank_files_load_strictly_and_match_hf(name, ckpt_factory, padded_batch, tmp_path):
    src = ckpt_factory(name, n_layer=4)
    convert(src, tmp_path / "t", "hf", "megatron-torch", tp_size=2, pp_size=2)
    _, ids, mask = padded_batch
    tests = Path(__file__).resolve().parents[1]
    with RemoteBackend("megatron_upstream:TorchFormatLoader", src, tp_size=2,
                       env={"PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests)])}) as ranks:
        got = ranks.torch_format_logits(str(tmp_path / "t"), ids, mask)
    ref = HFBackend.from_hf(src).logits(ids, mask)
    diff = (got - ref)[mask.bool()].abs().max().item()
    assert diff <= TOL, diff

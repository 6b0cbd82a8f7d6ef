"""gpt_bigcode with DeepSpeed tensor parallelism, TP=2, two real processes over gloo.

The ranks are started by plugins.launch.launcher (torchrun with LOCAL_SIZE, or the `deepspeed`
launcher); results come back from rank 0. The first run JIT-compiles DeepSpeed's shm comm op.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from checkpoint_variants import biased_copy

from plugins.core.config import ConfigError
from plugins.deepspeed import AutoTPBackend, DeepSpeedBackend
from plugins.engine.registry import load_backend
from plugins.hf import HFBackend

REPO = Path(__file__).resolve().parents[2]
TP = 2
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def random_bias_dir(ckpt_factory, tmp_path_factory):
    """tiny / tiny-mha with random biases and layer norms, so their TP handling is exercised."""
    made = {}

    def make(name):
        if name not in made:
            made[name] = biased_copy(ckpt_factory(name), tmp_path_factory.mktemp("tp") / name)
        return made[name]

    return make


CASES = [(DeepSpeedBackend, "tiny", "torchrun"), (DeepSpeedBackend, "tiny-mha", "torchrun"),
         (DeepSpeedBackend, "tiny", "deepspeed"), (AutoTPBackend, "tiny", "torchrun"),
         (AutoTPBackend, "tiny-mha", "deepspeed")]


@pytest.mark.slow
@pytest.mark.parametrize("backend,name,launcher", CASES, ids=[f"{b.name}-{n}-{lc}" for b, n, lc in CASES])
def test_tp2_balanced_shards_and_matches_hf(random_bias_dir, padded_batch, backend, name, launcher):
    """Injected TP (our container) and AutoTP (injection.autotp): whole query heads per rank."""
    hf_dir = random_bias_dir(name)
    hf = HFBackend.from_hf(hf_dir)
    cfg = hf.config
    n, head_dim = cfg.n_embd, cfg.n_embd // cfg.n_head
    ref_qkv = hf.model.transformer.h[0].attn.c_attn.weight.detach().t()  # [in, out] as DeepSpeed stores it
    _, ids, mask = padded_batch
    segments = shm_segments()
    with backend.from_hf(hf_dir, tp_size=TP, launcher=launcher) as ds:
        assert ds.tp_size == TP
        shards = ds.shard_info()
        logits = ds.logits(ids, mask)
        tokens = ds.generate(ids, mask, NEW_TOKENS).tokens
    assert shm_segments() <= segments  # DeepSpeed's all-reduce segments unlinked (compat patch 5)
    assert len(shards) == TP
    for rank, s in enumerate(shards):
        kv_width = 2 * head_dim if cfg.multi_query else 2 * n // TP
        assert s["attn_qkvw"] == (n, n // TP + kv_width)            # this rank's query heads + its K/V
        assert s["attn_ow"] == (n // TP, n) and s["output_w"] == (4 * n // TP, n) and s["inter_w"] == (n, 4 * n // TP)
        if cfg.multi_query:  # [Q heads of this rank | K | V]; K/V replicated and identical everywhere
            q = ref_qkv[:, rank * n // TP:(rank + 1) * n // TP]
            assert torch.equal(s["qkv_cols"], torch.cat([q, ref_qkv[:, n:]], 1))
            assert torch.equal(s["kv_cols"], shards[0]["kv_cols"])
        else:  # per-head [q, k, v] rows: one contiguous run of whole heads per rank
            width = 3 * n // TP
            assert torch.equal(s["qkv_cols"], ref_qkv[:, rank * width:(rank + 1) * width])
    real = mask.bool()
    assert (logits - hf.logits(ids, mask))[real].abs().max() <= 1e-5
    assert torch.equal(tokens, hf.generate(ids, mask, NEW_TOKENS).tokens)


def test_heads_not_divisible_by_tp_fails_before_any_rank_starts(ckpt_factory):
    hf_dir = ckpt_factory("tiny", n_embd=96, n_head=3)
    with pytest.raises(ConfigError, match="tp_size 2 does not divide n_head 3"):
        load_backend("deepspeed", hf_dir, tp_size=2)


def shm_segments() -> set:
    return set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"))


SHM_SCRIPT = r"""
import sys
import deepspeed
import torch.distributed as dist
from injection import compat
if sys.argv[1] == "patched":
    compat.patch_comm()
deepspeed.init_distributed(dist_backend="gloo")
if sys.argv[1] == "late":
    compat.patch_comm()  # too late: warns
with open(f"{sys.argv[2]}/segment{dist.get_rank()}", "w") as f:
    f.write(compat.shm_segment(dist.get_rank()))
dist.barrier()
"""


@pytest.mark.parametrize("mode", ["upstream", "patched", "late"])
def test_shm_allreduce_segments_are_not_left_in_dev_shm(tmp_path, mode):
    """Upstream DeepSpeed leaves one 67 MB /dev/shm segment per rank after every TP run (if this
    starts failing for 'upstream', DeepSpeed fixed it and compat patch 5 can go); ours leaves none.
    Patched after init_distributed, the segments stay and each rank says so."""
    script = tmp_path / "shm.py"
    script.write_text(SHM_SCRIPT)
    env = {**os.environ, "LOCAL_SIZE": str(TP)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={TP}",
                           str(script), mode, str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = [(tmp_path / f"segment{rank}").read_text() for rank in range(TP)]
    left = [Path("/dev/shm", n) for n in names if Path("/dev/shm", n).exists()]
    for path in left:
        path.unlink()
    assert len(left) == (0 if mode == "patched" else TP)
    assert proc.stderr.count("call injection.register() first") == (TP if mode == "late" else 0)


def test_orphaned_segments_are_swept_live_and_young_ones_kept():
    """What a rank killed before patch 5's unlink leaves (67 MB of RAM each): removed when no live
    process maps it; a mapped one, or one younger than a minute, is kept."""
    import mmap

    from injection.compat import sweep_shm_segments

    prefix = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_test{os.getpid()}_"
    orphan, mapped, young = (Path(prefix + name) for name in ("orphan", "mapped", "young"))
    for path in (orphan, mapped, young):
        path.write_bytes(b"\0" * 4096)
    old = time.time() - 3600
    os.utime(orphan, (old, old))
    os.utime(mapped, (old, old))
    with open(mapped, "r+b") as f, mmap.mmap(f.fileno(), 4096) as view:
        removed = sweep_shm_segments()
        assert view[:1] == b"\0"
    try:
        assert orphan.name in removed and not orphan.exists()
        assert mapped.exists() and young.exists()
    finally:
        for path in (mapped, young):
            path.unlink(missing_ok=True)


def test_launcher_options_reach_the_ranks(ckpt_factory):
    """timeout_s (and env, launcher) are options of the TP backend: a timeout too short to start is an error."""
    from plugins.launch.launcher import WorkerError

    with pytest.raises(WorkerError, match="did not answer within 0.5 s while starting"):
        load_backend("deepspeed", ckpt_factory("tiny"), tp_size=2, timeout_s=0.5)


NO_LOCAL_SIZE_SCRIPT = r"""
import sys
import torch.distributed as dist
from plugins.core.config import ConfigError
from plugins.deepspeed import DeepSpeedBackend
dist.init_process_group("gloo")
try:
    DeepSpeedBackend.from_hf(sys.argv[1], tp_size=2, device="cpu")
    print("NO ERROR", flush=True)
except ConfigError as e:
    print(f"RANK {dist.get_rank()} ConfigError: {e}", flush=True)
dist.destroy_process_group()
"""


def test_plain_torchrun_without_local_size_is_a_clear_error(ckpt_factory, tmp_path):
    """Two real ranks started without LOCAL_SIZE: refused before DeepSpeed runs (it would segfault)."""
    script = tmp_path / "no_local_size.py"
    script.write_text(NO_LOCAL_SIZE_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_SIZE"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script), str(ckpt_factory("tiny"))], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for rank in (0, 1):
        assert f"RANK {rank} ConfigError: DeepSpeed TP on CPU needs LOCAL_SIZE" in proc.stdout
    assert "LOCAL_SIZE=2 torchrun --nproc_per_node 2" in proc.stdout and "NO ERROR" not in proc.stdout


def test_upstream_autotp_grain_is_the_kv_head_count_and_bigcode_split_assumes_mqa():
    """What injection.autotp works around; fails if upstream changes these."""
    import inspect

    from deepspeed.module_inject import fusedqkv_utils
    from deepspeed.module_inject.tp_shard import AutoTPMeta, get_shard_size_list

    from injection import compat

    # MQA's one KV head as the grain: every query row / c_proj input column goes to rank 0
    assert get_shard_size_list(256, 2, AutoTPMeta(num_kv_heads=1), name="attn.c_proj") == [256, 0]
    assert get_shard_size_list(256, 2, AutoTPMeta(num_kv_heads=4), name="attn.c_proj") == [128, 128]
    assert fusedqkv_utils.FUSED_QKV_TYPE_DICT["GPTBigCodeBlock"] == "bigcodetype"
    assert "q = input[:n_embd]" in inspect.getsource(fusedqkv_utils.prepare_tp_fused_qkvw)
    with compat.mha_bigcode_qkv_as_bloom(True):
        assert fusedqkv_utils.FUSED_QKV_TYPE_DICT["GPTBigCodeBlock"] == "bloomtype"
    assert fusedqkv_utils.FUSED_QKV_TYPE_DICT["GPTBigCodeBlock"] == "bigcodetype"


def test_injected_qkv_shard_rule():
    from injection.tp import qkv_rows
    from plugins.core.config import load_model_config

    mqa, mha = load_model_config("tiny"), load_model_config("tiny-mha")  # 64 wide, 4 heads of 16
    # MQA, tp 2: rank 1 holds heads 2-3 and the one K/V head
    assert qkv_rows(mqa, 1, 2).tolist() == list(range(32, 64)) + list(range(64, 96))
    # MHA: per-head [q, k, v] rows, heads 2-3 -> rows 96..191
    assert qkv_rows(mha, 1, 2).tolist() == list(range(96, 192))
    with pytest.raises(ValueError, match="does not divide n_head"):
        qkv_rows(mqa, 0, 3)


def test_upstream_inference_all_reduce_runs_the_shm_kernel_unless_its_vector_level_is_low():
    """What compat patch 5 relies on across machines (upstream inits no shm segment when LOCAL_SIZE < world
    size, yet its inference_all_reduce would still run the shm kernel); fails if upstream changes this."""
    import inspect

    from deepspeed.comm.torch import TorchBackend

    source = inspect.getsource(TorchBackend.inference_all_reduce)
    assert "getattr(self, 'shm_vector_kernel_level', 0) >= required_level" in source
    assert "torch.distributed.all_reduce(" in source
    assert "if (size >= 1 && size == ls) { all_ranks_local_p = true; }" in _shm_interface_source()


def _shm_interface_source() -> str:
    import deepspeed

    return (Path(deepspeed.__file__).parent / "ops/csrc/cpu/comm/shm_interface.cpp").read_text()


def test_the_ranks_group_is_gloo_on_cpu_and_adds_nccl_for_cuda_tensors():
    """CPU ranks: gloo alone. CUDA ranks: one group with gloo for CPU tensors and NCCL for CUDA ones; the
    worker's requests and rank lists are object collectives, which torch sends through the group's CPU
    backend when it has one (this fails if upstream's rule changes)."""
    import inspect

    from torch.distributed.distributed_c10d import _get_object_coll_device

    from plugins.core.tensors import process_group_backend

    assert process_group_backend(cuda=False) == "gloo"
    nccl = torch.distributed.is_nccl_available()
    assert process_group_backend(cuda=True) == ("cpu:gloo,cuda:nccl" if nccl else "gloo")
    assert process_group_backend() == ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() and nccl else "gloo")
    rule = inspect.getsource(_get_object_coll_device)
    assert 'elif torch.device("cpu") in devices:' in rule and 'return "cpu"' in rule.split("cpu\") in devices:")[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ranks_all_reduce_over_nccl_and_pass_objects_over_gloo(tmp_path):
    script = tmp_path / "group.py"
    script.write_text("""
import torch, torch.distributed as dist
from plugins.core.tensors import process_group_backend, use_local_gpu
use_local_gpu()
dist.init_process_group(process_group_backend())
x = torch.ones(4, device="cuda") * (dist.get_rank() + 1)
dist.all_reduce(x)
objects = [None] * dist.get_world_size()
dist.all_gather_object(objects, {"rank": dist.get_rank()})
assert x.tolist() == [sum(range(1, dist.get_world_size() + 1))] * 4, x
assert objects == [{"rank": r} for r in range(dist.get_world_size())], objects
assert dist.get_backend(dist.group.WORLD) == "cpu:gloo,cuda:nccl", dist.get_backend(dist.group.WORLD)
print("ok", torch.cuda.current_device())
dist.destroy_process_group()
""")
    n = min(torch.cuda.device_count(), 2)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                          str(script)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("ok") == n

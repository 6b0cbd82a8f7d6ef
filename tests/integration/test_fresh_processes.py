"""What only a fresh Python process shows: a writer SIGKILLed mid-write leaves the old output and the
next run sweeps its temp dir; DeepSpeed's own injection of GPT-2 is the same with and without
`injection.register()`; a planted pickle in a Megatron-LM stage never runs, even with torch's escape
hatch set before torch loads."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from converters import convert, megatron_legacy
from plugins.core.atomic import sweep_stale_temps

REPO = Path(__file__).resolve().parents[2]


def stage_file(d, tp, pp, pp_size, it="release"):
    return megatron_legacy.rank_dir(Path(d) / it, tp, pp, pp_size) / "model_optim_rng.pt"


def test_stale_temp_of_a_killed_writer_is_swept_live_ones_are_kept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".out.tmp-{dead.pid}-abc"
    stale.mkdir()
    live = tmp_path / f".out.tmp-{os.getppid()}-def"  # a process that is alive
    live.mkdir()
    assert sweep_stale_temps(tmp_path / "out") == [stale]
    assert not stale.exists() and live.exists()


def test_sigkill_mid_write_leaves_the_old_dst_and_the_next_run_sweeps(ckpt_factory, tmp_path):
    """A real SIGKILL while converting: DST still holds the old complete output; the next
    conversion to DST removes the killed writer's temp dir."""
    src = ckpt_factory("small")
    dst = tmp_path / "out"
    convert(ckpt_factory("tiny"), dst, "hf", "hf")
    old = (dst / "config.json").read_text()
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); from converters import convert; "
            f"convert({str(src)!r}, {str(dst)!r}, 'hf', 'megatron-legacy', force=True)")
    proc = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".out.tmp-*")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the writer finished before it could be killed"
    assert list(tmp_path.glob(".out.tmp-*")), "no temp dir to sweep"
    assert (dst / "config.json").read_text() == old  # the old complete output, untouched
    convert(ckpt_factory("tiny"), dst, "hf", "hf", force=True)
    assert not list(tmp_path.glob(".out.tmp-*"))


GPT2_SCRIPT = r"""
import json, sys, torch, deepspeed
from transformers import GPT2Config, GPT2LMHeadModel
if sys.argv[1] == "register":
    import injection
    injection.register()
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=64)).eval()
ids = torch.randint(0, 500, (2, 7))
try:
    engine = deepspeed.init_inference(model, dtype=torch.float32, replace_with_kernel_inject=True)
    with torch.no_grad():
        logits = engine.module(ids).logits
    out = {"modules": [type(m).__name__ for m in engine.module.modules()], "logits": logits.flatten().tolist()}
except Exception as e:
    out = {"error": f"{type(e).__name__}: {e}"}
print("RESULT " + json.dumps(out))
"""


def test_gpt2_is_injected_exactly_as_without_us():
    """Fresh processes, with and without register(): same modules and outputs (on CPU both get
    DeepSpeed's own 'not implemented on CPU' error; with CUDA, DeepSpeed's GPT2 layers)."""
    results = []
    for mode in ("plain", "register"):
        proc = subprocess.run([sys.executable, "-c", GPT2_SCRIPT, mode], cwd=REPO, capture_output=True, text=True,
                              timeout=300)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        assert line, proc.stdout + proc.stderr
        results.append(json.loads(line[0][len("RESULT "):]))
    assert results[0] == results[1]
    if not torch.cuda.is_available():
        assert "not been implemented on CPU" in results[0]["error"]


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['PAYLOAD_MARKER']}",))


def test_a_planted_pickle_never_runs_even_with_torchs_escape_hatch(ckpt_factory, tmp_path):
    """A checkpoint whose args run a command when unpickled: refused, also with
    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 (which turns torch.load's default off); the command never runs."""
    convert(ckpt_factory("tiny"), tmp_path / "l", "hf", "megatron-legacy")
    f = stage_file(tmp_path / "l", 0, 0, 1)
    ck = torch.load(f, map_location="cpu", weights_only=False)  # ours: trusted, and fully in memory
    marker = tmp_path / "pwned"
    os.environ["PAYLOAD_MARKER"] = str(marker)
    try:
        ck["args"].tokenizer_type = _Payload()
        torch.save(ck, f)
    finally:
        del os.environ["PAYLOAD_MARKER"]
    code = ("import sys; from converters import convert\n"
            f"try:\n    convert({str(tmp_path / 'l')!r}, {str(tmp_path / 'hf')!r}, 'megatron-legacy', 'hf')\n"
            "except Exception as e:\n    print(type(e).__name__, e); sys.exit(3)")
    env = {**os.environ, "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1", "PAYLOAD_MARKER": str(marker),
           "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3 and "ConversionError" in proc.stdout and "posix.system" in proc.stdout, proc.stdout
    assert not marker.exists() and not (tmp_path / "hf").exists()

"""Every code block of README.md runs as written, on tiny models.

Python blocks run as scripts, bash blocks with bash -e, from the repository root with the pinned
environment first on PATH (as after `source .venv/bin/activate`). Model names of the real shapes
become the tiny configs of the same architecture and `/tmp/mqa` a fresh directory; nothing else of
a block is changed. A block whose first line is `# not run by the tests` is skipped (the tests' own
commands, paths of real training runs, half-hour benchmarks); a python block whose first line is
`# continues the block above` runs after the block before it, in one script; one that starts with
PEERS below skips when llama.cpp is not built (`make peers`). YAML blocks must parse as bench configs.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
SKIP, CONTINUES, PEERS = "# not run by the tests", "# continues the block above", "# after `make peers`"
SUBSTITUTIONS = [("santacoder-1b-mha", "tiny-mha"), ("santacoder-1b", "tiny")]


def blocks():
    text = (REPO / "README.md").read_text()
    found, python = [], None
    for m in re.finditer(r"^```(\w+)\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
        lang, code = m.group(1), m.group(2)
        line = text[: m.start()].count("\n") + 1
        if lang not in ("python", "bash", "yaml") or code.startswith(SKIP):
            continue
        if lang == "python" and code.startswith(CONTINUES):
            code = python + "\n" + code
        if lang == "python":
            python = code
        found.append(pytest.param(lang, code, id=f"README.md:{line}-{lang}"))
    return found


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    ws = tmp_path_factory.mktemp("mqa")
    from plugins.core.checkpoint import create_checkpoint
    from plugins.core.config import load_model_config

    for name in ("tiny", "tiny-mha"):  # what the blocks before a block would have made
        create_checkpoint(load_model_config(name), ws / name, seed=0)
    return ws


def localize(code: str, ws: Path) -> str:
    for old, new in SUBSTITUTIONS:
        code = code.replace(old, new)
    return code.replace("/tmp/mqa", str(ws))


def test_readme_has_the_blocks_a_user_needs():
    langs = [p.values[0] for p in blocks()]
    assert langs.count("python") >= 8 and langs.count("bash") >= 6 and "yaml" in langs


@pytest.mark.parametrize("lang, code", blocks())
def test_readme_block_runs(lang, code, workspace, tmp_path):
    if code.startswith(PEERS):
        pytest.importorskip("plugins.peers.llamacpp", exc_type=ImportError)
    code = localize(code, workspace)
    if lang == "yaml":
        from plugins.bench.config import parse_bench_config

        parse_bench_config(yaml.safe_load(code), name="README")
        return
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
           "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    if lang == "python":
        script = tmp_path / "block.py"
        script.write_text(code)
        cmd = [sys.executable, str(script)]
    else:
        cmd = ["bash", "-euo", "pipefail", "-c", code]
    segments = set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{code}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    # a TP example that leaves DeepSpeed's 67 MB all-reduce segments in /dev/shm is not one to copy
    assert set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")) <= segments

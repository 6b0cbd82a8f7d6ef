"""Every code block of README.md and of the topic pages docs/*.md runs as written, on tiny models.

Python blocks run as scripts, bash blocks with bash -e, from the repository root with the pinned
environment first on PATH (as after `source .venv/bin/activate`). Model names of the real shapes
become the tiny configs of the same architecture and `/tmp/mqa` a fresh directory; nothing else of
a block is changed. A block whose first line is `# not run by the tests` is skipped (the tests' own
commands, paths of real training runs, half-hour benchmarks); a python block whose first line is
`# continues the block above` runs after the previous python block of the same page, in one script;
one that starts with PEERS below skips when llama.cpp is not built (`make peers`). YAML blocks must
parse as bench configs. The dated pages in docs/results/ hold the commands that made their tables
(minutes to hours each): every block there is marked `# not run by the tests`.
"""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
README, DOCS = REPO / "README.md", REPO / "docs"
SKIP, CONTINUES, PEERS = "# not run by the tests", "# continues the block above", "# after `make peers`"
SUBSTITUTIONS = [("santacoder-1b-mha", "tiny-mha"), ("santacoder-1b", "tiny"), ("starcoder2-3b", "tiny-starcoder2")]
RUNNABLE = ("python", "bash", "yaml")
README_MAX_LINES = 300


def pages() -> list:
    """The pages whose blocks run: README.md, then the topic pages docs/*.md (not docs/results/)."""
    return [README, *sorted(DOCS.glob("*.md"))]


def fenced(path: Path):
    """(line of the opening fence, language or "", code) of every fenced block of a markdown file."""
    text = path.read_text()
    for m in re.finditer(r"^```(\S*)\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
        yield text[: m.start()].count("\n") + 1, m.group(1), m.group(2)


def blocks(paths=None) -> list:
    found = []
    for path in pages() if paths is None else paths:
        name, python = path.relative_to(REPO).as_posix(), None   # a continuation stays within its page
        for line, lang, code in fenced(path):
            if lang not in RUNNABLE or code.startswith(SKIP):
                continue
            if lang == "python" and code.startswith(CONTINUES):
                if python is None:
                    raise ValueError(f"{name}:{line}: '{CONTINUES}' with no python block above it on this page")
                code = python + "\n" + code
            if lang == "python":
                python = code
            found.append(pytest.param(lang, code, id=f"{name}:{line}-{lang}"))
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
    found = [p.values for p in blocks([README])]
    python = [code for lang, code in found if lang == "python"]
    bash = [code for lang, code in found if lang == "bash"]
    assert len(python) >= 1 and len(bash) >= 5
    assert any("deepspeed.init_inference" in code and "injection.register()" in code for code in python)
    assert any("torchrun" in code and "--nproc_per_node 2" in code for code in bash)          # a TP=2 launch
    assert any("mqa-convert --from hf --to megatron" in code for code in bash)                # conversion
    assert any("mqa-serve" in code and "/v1/completions" in code for code in bash)            # serving
    assert any("mqa-compare" in code for code in bash)                                        # the comparison
    assert "yaml" in [p.values[0] for p in blocks()]   # a bench config, in docs/bench.md


def test_readme_is_a_front_door():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_results_pages_run_nothing():
    pages = sorted((DOCS / "results").glob("*.md"))
    assert pages
    for path in pages:
        for line, lang, code in fenced(path):
            assert not lang or code.startswith(SKIP), \
                f"{path.relative_to(REPO)}:{line}: a block of a results page must start with '{SKIP}'"


def test_relative_links_resolve():
    broken = []
    for path in [README, *sorted(DOCS.rglob("*.md"))]:
        text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)
        text = re.sub(r"`[^`]*`", "", text)   # inline code is not a link
        for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
                continue   # http:, https:, mailto: ... and anchors within the page
            resolved = (path.parent / target.split("#", 1)[0]).resolve()
            if not resolved.exists() or REPO.resolve() not in (resolved, *resolved.parents):
                broken.append(f"{path.relative_to(REPO)}: {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


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
    segments = shm_segments()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{code}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    # a TP example that leaves DeepSpeed's 67 MB all-reduce segments in /dev/shm is not one to copy
    assert not left_segments(segments)


def shm_segments() -> set:
    return {p.name for p in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*")}


def left_segments(before: set) -> set:
    """Segments made since `before` that no live process maps, and still there a moment later: those of
    another test running beside this one (pytest -n) are mapped by its ranks, or about to be unlinked."""
    from injection.compat import mapped_shm_segments

    new = shm_segments() - before - mapped_shm_segments()
    if new:
        time.sleep(2)
    return new & shm_segments() - mapped_shm_segments()

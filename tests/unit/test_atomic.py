"""Atomic outputs (plugins.core.atomic): DST is absent, the old or the new complete output at every
instant; racing writers, SRC inside DST, non-checkpoint DSTs
(killed writers: tests/integration/test_fresh_processes.py)."""

import os
import threading
from pathlib import Path

import pytest

from converters import convert
from converters.mapping import ConversionError
from plugins.core.atomic import RENAME_EXCHANGE, OutputError, atomic_dir, rename2



def write_marker(d: Path, text: str) -> None:
    (d / "config.json").write_text(text)


def test_new_output_appears_complete_and_failure_leaves_nothing(tmp_path):
    dst = tmp_path / "out"
    with atomic_dir(dst) as tmp:
        write_marker(tmp, "new")
        assert not dst.exists()  # nothing at DST while it is written
    assert (dst / "config.json").read_text() == "new"
    with pytest.raises(RuntimeError), atomic_dir(tmp_path / "other") as tmp:
        write_marker(tmp, "half")
        raise RuntimeError("crash while writing")
    assert not (tmp_path / "other").exists() and not list(tmp_path.glob(".other.tmp-*"))


def test_existing_dst_needs_force_and_force_swaps_atomically(tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    write_marker(dst, "old")
    with pytest.raises(OutputError, match="already exists"), atomic_dir(dst):
        pass
    with atomic_dir(dst, force=True) as tmp:
        write_marker(tmp, "new")
        assert (dst / "config.json").read_text() == "old"  # the old output stays whole until the swap
    assert (dst / "config.json").read_text() == "new"
    assert not list(tmp_path.glob(".out.*"))  # the old one is deleted after the swap


def test_rename_exchange_is_what_force_uses():
    """The swap is one renameat2(RENAME_EXCHANGE): both paths exist before and after."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        a, b = Path(d, "a"), Path(d, "b")
        a.mkdir(), b.mkdir()
        (a / "x").write_text("a"), (b / "x").write_text("b")
        rename2(a, b, RENAME_EXCHANGE)
        assert (a / "x").read_text() == "b" and (b / "x").read_text() == "a"


def test_two_writers_racing_for_one_dst_one_wins_one_errors(tmp_path):
    dst, results = tmp_path / "out", []
    barrier = threading.Barrier(2)

    def writer(name):
        try:
            with atomic_dir(dst) as tmp:
                write_marker(tmp, name)
                barrier.wait()  # both have checked that DST is absent and written their output
            results.append(("ok", name))
        except OutputError as e:
            results.append(("error", str(e)))

    threads = [threading.Thread(target=writer, args=(n,)) for n in ("a", "b")]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert sorted(r[0] for r in results) == ["error", "ok"], results
    winner = next(r[1] for r in results if r[0] == "ok")
    assert (dst / "config.json").read_text() == winner
    assert "appeared while writing" in next(r[1] for r in results if r[0] == "error")
    assert not list(tmp_path.glob(".out.tmp-*"))


@pytest.mark.parametrize("where", ["same", "parent"])
def test_dst_that_is_or_holds_src_is_refused_even_with_force(where, ckpt_factory, tmp_path):
    src = tmp_path / "parent" / "src"
    src.parent.mkdir()
    import shutil

    shutil.copytree(ckpt_factory("tiny"), src)
    dst = src if where == "same" else src.parent
    if where == "parent":
        write_marker(dst, "{}")  # even a DST that looks like a checkpoint
    with pytest.raises(ConversionError, match="SRC|parent of SRC"):
        convert(src, dst, "hf", "hf", force=True)
    assert (src / "model.safetensors").is_file()


def test_non_checkpoint_file_symlink_dsts_are_refused(ckpt_factory, tmp_path):
    src = ckpt_factory("tiny")
    plain = tmp_path / "photos"
    plain.mkdir()
    (plain / "cat.jpg").write_text("meow")
    with pytest.raises(ConversionError, match="not a checkpoint directory"):
        convert(src, plain, "hf", "hf", force=True)
    assert (plain / "cat.jpg").read_text() == "meow"
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(ConversionError, match="not a directory"):
        convert(src, afile, "hf", "hf", force=True)
    link = tmp_path / "link"
    link.symlink_to(plain)
    with pytest.raises(ConversionError, match="symbolic link"):
        convert(src, link, "hf", "hf", force=True)
    assert not list(tmp_path.glob(".*.tmp-*"))


def test_read_only_parent_is_one_clear_error(ckpt_factory, tmp_path):
    if os.geteuid() == 0:  # root writes anywhere: use a file system that is really read-only
        ro = Path("/proc/self")
        with pytest.raises(ConversionError, match="cannot write"):
            convert(ckpt_factory("tiny"), ro / "out", "hf", "hf")
        return
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    with pytest.raises(ConversionError, match="cannot write"):
        convert(ckpt_factory("tiny"), ro / "out", "hf", "hf")


def test_outputs_follow_the_umask(ckpt_factory, tmp_path):
    old = os.umask(0o022)
    try:
        convert(ckpt_factory("tiny"), tmp_path / "l", "hf", "megatron-legacy", tp_size=2)
    finally:
        os.umask(old)
    assert (tmp_path / "l").stat().st_mode & 0o777 == 0o755
    for path in (tmp_path / "l").rglob("*"):
        assert path.stat().st_mode & 0o777 == (0o755 if path.is_dir() else 0o644), path

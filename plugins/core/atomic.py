"""Writing an output directory so that at every instant DST is either absent, the old complete
output, or the new complete output.

The output is written into a temp dir beside DST (`.DST.tmp-<pid>-<random>`), then published by
one `renameat2` system call: RENAME_NOREPLACE when DST must not exist (two writers racing for one
DST: exactly one wins, the other gets an error), RENAME_EXCHANGE to replace an existing DST with
`force` (old and new swap atomically; the old one, now at the temp path, is deleted after). A temp
dir whose writer process is gone (killed mid-write) is swept by the next write to the same DST.
Where renameat2 is unavailable (not Linux, or a file system without it) the fallback renames the
old DST aside first, so a crash between two renames can leave DST missing (never half-written).
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from plugins.core.config import ConfigError

RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
AT_FDCWD = -100
# What marks a directory as a checkpoint this project writes (HF and megatron-core: config.json;
# Megatron-LM legacy: the tracker file). `force` replaces only such a directory.
CHECKPOINT_MARKERS = ("config.json", "latest_checkpointed_iteration.txt")


class OutputError(ConfigError):
    """DST cannot be written: it exists, is not a checkpoint, holds SRC, or the write failed."""


def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc if hasattr(libc, "renameat2") else None
    except OSError:
        return None


_LIBC = _libc()


def rename2(src: Path, dst: Path, flags: int) -> None:
    """renameat2(2); OSError(ENOSYS) where the C library or the kernel lacks it."""
    if _LIBC is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    if _LIBC.renameat2(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(dst))


def is_checkpoint_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and any((path / m).exists() for m in CHECKPOINT_MARKERS)


def check_destination(dst: Path, force: bool, sources=()) -> None:
    """Refuse, before any work, a DST that cannot or must not be replaced."""
    dst = Path(dst)
    if dst.is_symlink():
        raise OutputError(f"{dst} is a symbolic link; give the real output path")
    if dst.exists() and not dst.is_dir():
        raise OutputError(f"{dst} exists and is not a directory")
    target = dst.resolve()
    for src in sources:
        src = Path(src).resolve()
        if target == src or target in src.parents:
            raise OutputError(f"{dst} is {'SRC' if target == src else 'a parent of SRC'} ({src}): "
                              "writing there would destroy the input")
    if dst.exists():
        if not force:
            raise OutputError(f"{dst} already exists (pass force=True / --force to replace it)")
        if not is_checkpoint_dir(dst):
            raise OutputError(f"{dst} exists and is not a checkpoint directory (no "
                              f"{' or '.join(CHECKPOINT_MARKERS)}); refusing to replace it")


def process_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(") ")[2][:1] != "Z"
    except OSError:
        return True


def sweep_stale_temps(dst: Path) -> list[Path]:
    """Remove `.DST.tmp-<pid>-*` dirs beside DST whose writer process no longer runs."""
    swept = []
    for tmp in dst.parent.glob(f".{dst.name}.tmp-*"):
        pid = tmp.name[len(f".{dst.name}.tmp-"):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not process_alive(int(pid)) and tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
            swept.append(tmp)
    return swept


def _apply_umask(root: Path) -> None:
    """mkdtemp makes its directory 0700 and some writers make 0600 files: give the output the modes a
    plain mkdir / open would have under the user's umask."""
    mask = os.umask(0)
    os.umask(mask)
    root.chmod(0o777 & ~mask)
    for path in root.rglob("*"):
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def _publish(tmp: Path, dst: Path, force: bool) -> None:
    _apply_umask(tmp)
    try:
        try:
            rename2(tmp, dst, RENAME_NOREPLACE)
            return
        except FileExistsError:
            if not force:
                raise OutputError(f"{dst} appeared while writing (another writer?); nothing was replaced") from None
            rename2(tmp, dst, RENAME_EXCHANGE)  # tmp now holds the old output
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        if e.errno not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            raise
        _publish_fallback(tmp, dst, force)


def _publish_fallback(tmp: Path, dst: Path, force: bool) -> None:
    old = None
    if dst.exists():
        if not force:
            raise OutputError(f"{dst} appeared while writing (another writer?); nothing was replaced")
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        os.rename(dst, old)
    os.rename(tmp, dst)  # fails (ENOTEMPTY) rather than replace a non-empty directory
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_dir(dst: str | Path, force: bool = False, sources=()):
    """Yield a temp dir beside `dst`; on success it becomes `dst` atomically, on error it is removed.

    `sources`: input paths DST must not be or contain. OSErrors of the write (read-only file
    system, disk full) come out as one OutputError naming DST."""
    dst = Path(dst)
    check_destination(dst, force, sources)
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        sweep_stale_temps(dst)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-{os.getpid()}-", dir=dst.parent))
    except OSError as e:
        raise OutputError(f"cannot write {dst}: {e.strerror or e}") from None
    try:
        yield tmp
        _publish(tmp, dst, force)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and not isinstance(e, OutputError):
            raise OutputError(f"cannot write {dst}: {e.strerror or e}") from None
        raise

"""Files written so that nothing is lost: a probe before long work, atomic replacement after it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["check_writable", "atomic_write_text"]


def check_writable(path: str | os.PathLike) -> Path:
    """Raise ``ValueError`` unless a file can be written at ``path`` (call it before long work)."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise ValueError(f"cannot write {path}: folder {folder} does not exist")
    if path.is_dir():
        raise ValueError(f"cannot write {path}: it is a folder")
    # A real probe: os.access says yes to root on a read-only file system, and a long job would then fail
    # at its first save.
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=folder)
    except OSError as e:
        raise ValueError(f"cannot write {path}: folder {folder} is not writable ({e.strerror})") from None
    os.close(fd)
    os.unlink(probe)
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temporary file in the same folder, fsync, rename)."""
    path = check_writable(path)
    folder = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes it private; results are meant to be read by others
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise

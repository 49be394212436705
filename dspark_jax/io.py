"""Files written so that nothing is lost: a probe before long work, atomic replacement after it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

__all__ = ["check_writable", "atomic_write_text", "atomic_write_file", "atomic_folder", "read_json_object"]


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
    atomic_write_file(path, lambda f: f.write(text.encode()))


def atomic_write_file(path: str | os.PathLike, write: Callable[[BinaryIO], Any]) -> None:
    """Call ``write(f)`` on a binary file that appears at ``path`` only once complete (temporary file in the
    same folder, fsync, rename); on an error ``path`` is untouched.

    >>> import tempfile
    >>> p = Path(tempfile.mkdtemp()) / "x.bin"
    >>> atomic_write_file(p, lambda f: f.write(b"abc")); p.read_bytes()
    b'abc'
    """
    path = check_writable(path)
    folder = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes it private; results are meant to be read by others
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike) -> Iterator[Path]:
    """Build a folder in a temporary sibling and put it at ``path`` in one rename once the block succeeds
    (a folder already there is replaced); on an error the temporary folder goes and ``path`` is untouched.

    >>> import tempfile
    >>> root = Path(tempfile.mkdtemp())
    >>> with atomic_folder(root / "drafter") as tmp:
    ...     _ = (tmp / "config.json").write_text("{}")
    >>> sorted(p.name for p in (root / "drafter").iterdir())
    ['config.json']
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; drafters and tables are meant to be read by others
    try:
        yield tmp
        old = None
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old.", dir=path.parent))
            os.rmdir(old)
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_json_object(path: str | os.PathLike, *, required: bool = True, error: type[ValueError] = ValueError,
                     missing: str = "missing") -> dict[str, Any]:
    """The JSON object in ``path``; ``{}`` for a missing file unless ``required``. Raises ``error`` (a ValueError)
    naming the file: missing (with the ``missing`` explanation), not valid JSON, or not an object.

    >>> read_json_object("no/such/config.json", required=False)
    {}
    """
    path = Path(path)
    if not path.is_file():
        if required:
            raise error(f"{path}: {missing}")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data

"""Writing a file whole: the one way the package replaces a file it owns.

:func:`write_atomic` writes through a fresh temporary file beside the target, flushes it to
disk and renames it over the target, so that a reader, or a run killed at any instant, sees the
old file or the new one and never a part of either; a failed write removes its temporary file
and leaves the target as it was.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import BinaryIO, Callable

Content = bytes | str | Callable[[BinaryIO], object]


def write_atomic(path: str | os.PathLike, content: Content, *, mode: int = 0o666) -> Path:
    """Replaces ``path`` with ``content`` in one rename; returns ``path`` as a ``Path``.

    Args:
      path: the file to write; its folder must exist.
      content: the bytes, a str (written as UTF-8), or a function that writes to the binary
        file object it is given (a figure's ``savefig``, a ``csv`` writer over a wrapper).
      mode: permission bits of a new file before the umask (``0o600``: the owner's only).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(content):
                content(f)
            else:
                f.write(content.encode() if isinstance(content, str) else content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


__all__ = ["write_atomic"]

"""Writing a file whole: a reader (or the next start after a crash) finds the old file or the new
one, never half of either.

``atomic_write``: the bytes to a temporary file beside the target, fsynced, renamed over it, and
the folder fsynced, so the rename itself survives a power cut (a rename lives in the folder, not
in the file). Used by the producer's output files (summary, failures, the shards' checkpoint) and
the workers' spool.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, *, tmp: Path | None = None) -> None:
    """Replace ``path`` with ``data``. ``tmp``: the temporary file (default ``<path>.tmp``); writers
    that share a folder and may write the same name at once give each its own (a pid in it)."""
    tmp = tmp or path.with_name(path.name + ".tmp")
    with tmp.open("wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)

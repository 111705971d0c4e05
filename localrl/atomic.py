"""Writes that are all or nothing: a reader (or a resume after a crash) sees the old state or the new one.

Everything is first written beside its destination under a hidden temporary name, then
renamed into place; on failure the temporary is removed and the destination is untouched.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def atomic_dir(final: Path, fsync: bool = False) -> Iterator[Path]:
    """Yield an empty temporary directory; on success it replaces ``final``."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        yield tmp
        if fsync:
            for f in sorted(tmp.rglob("*")):
                if f.is_file():
                    with f.open("rb") as fh:
                        os.fsync(fh.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` in one rename."""
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` in one rename."""
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_bytes(data)
    os.replace(tmp, path)

"""Crash-safe file handling: everything is written under a temporary name, fsynced, then renamed.

A reader therefore sees either the previous complete file or the new complete file, never half of one.
Temporary names carry the marker ``.partial-`` so that a later run can find and remove leftovers of a killed one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterator

PARTIAL_MARKER = ".partial-"
_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_json(value) -> str:
    """Digest of a JSON-able value, independent of key order."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())


def partial_name(final: Path) -> Path:
    return final.with_name(f"{final.name}{PARTIAL_MARKER}{os.getpid()}")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_name(path)
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: Path, value) -> None:
    atomic_write_text(path, json.dumps(value, indent=2, sort_keys=False, default=str) + "\n")


def remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


@contextlib.contextmanager
def atomic_output(final: Path) -> Iterator[Path]:
    """Yield a temporary path (file or folder, the caller decides) that replaces ``final`` on success.

    On an exception the temporary path is removed and ``final`` is left as it was.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_name(final)
    remove_path(tmp)
    try:
        yield tmp
        if not tmp.exists():
            raise RuntimeError(f"nothing was written to {tmp}")
        _fsync_tree(tmp)
        if final.exists():
            # A directory cannot be replaced by rename in one step: move the old one aside first.
            old = final.with_name(f"{final.name}{PARTIAL_MARKER}old-{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
            remove_path(old)
        else:
            os.replace(tmp, final)
        _fsync_dir(final.parent)
    finally:
        remove_path(tmp)


def find_partials(root: Path) -> list[Path]:
    """Leftovers of killed writes below ``root`` (not descending into them)."""
    if not root.exists():
        return []
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in list(dirnames) + filenames:
            if PARTIAL_MARKER in name:
                found.append(Path(dirpath) / name)
        dirnames[:] = [d for d in dirnames if PARTIAL_MARKER not in d]
    return sorted(found)


def file_records(path: Path) -> dict[str, dict]:
    """Size and sha256 of a file, or of every file in a folder keyed by relative path."""
    if path.is_file():
        return {path.name: {"size": path.stat().st_size, "sha256": sha256_file(path)}}
    records = {}
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        records[file.relative_to(path).as_posix()] = {"size": file.stat().st_size, "sha256": sha256_file(file)}
    return records


def total_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())

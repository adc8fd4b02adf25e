"""The run directory and its manifest, ``run.json``.

Every stage is recorded under a key (``fetch``, ``quantize/gguf-q4km``, ...) with a digest of its inputs, the files it
produced (size and sha256, relative to the run directory), its settings, its result and its timing. A stage is done
when the manifest holds it with the same input digest and its outputs are still on disk with the recorded sizes; a
re-run skips it, so resume and "nothing redone" mean the same thing for every executor.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import __version__
from .errors import QuantforgeError
from .fsutil import atomic_write_json, file_records, find_partials, remove_path, sha256_json
from .memory import StagePeak, release_freed_memory
from .rundir import MANIFEST_NAME

LOCK_NAME = ".quantforge.lock"
SCHEMA = 1


def host_facts() -> dict:
    return {
        "hostname": platform.node(),
        "machine": platform.machine(),
        "system": platform.system(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


@dataclass
class StageResult:
    key: str
    result: dict
    outputs: dict
    skipped: bool
    seconds: float


@dataclass
class Manifest:
    run_dir: Path
    data: dict = field(default_factory=dict)

    @property
    def path(self) -> Path:
        return self.run_dir / MANIFEST_NAME

    @classmethod
    def open(cls, run_dir: Path) -> "Manifest":
        path = run_dir / MANIFEST_NAME
        if path.exists():
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise QuantforgeError(
                    f"{path} is not valid JSON ({exc.msg}, line {exc.lineno}): move it away or rerun with --force"
                ) from None
        else:
            data = {"schema": SCHEMA, "quantforge_version": __version__, "created": _now(), "stages": {}}
        data.setdefault("stages", {})
        return cls(run_dir, data)

    def save(self) -> None:
        self.data["updated"] = _now()
        atomic_write_json(self.path, self.data)

    @property
    def stages(self) -> dict:
        return self.data["stages"]

    def stage(self, key: str) -> dict | None:
        return self.stages.get(key)

    def is_done(self, key: str, input_digest: str) -> bool:
        record = self.stages.get(key)
        if not record or record.get("input_digest") != input_digest:
            return False
        for rel, files in record.get("outputs", {}).items():
            base = self.run_dir / rel
            for name, info in files.items():
                path = base if base.is_file() else base / name
                if not path.exists() or path.stat().st_size != info["size"]:
                    return False
        return True

    def output_digest(self, key: str) -> str:
        """What downstream stages hash as this stage's contribution to their inputs."""
        record = self.stages[key]
        return sha256_json({"outputs": record.get("outputs", {}), "result": record.get("result", {})})


def run_stage(
    manifest: Manifest,
    key: str,
    *,
    inputs: dict,
    settings: dict,
    outputs: list[Path],
    produce: Callable[[], dict],
    force: bool = False,
) -> StageResult:
    """Run ``produce`` unless the manifest already holds this stage with the same inputs and its outputs on disk.

    ``produce`` must write each of ``outputs`` atomically (see ``fsutil.atomic_output``) and return the stage's
    result, a JSON-able dict of measurements and facts. The stage is recorded only after its outputs exist.
    """
    input_digest = sha256_json({"inputs": inputs, "settings": settings, "quantforge": __version__})
    if not force and manifest.is_done(key, input_digest):
        record = manifest.stages[key]
        return StageResult(key, record.get("result", {}), record.get("outputs", {}), True, record.get("seconds", 0.0))
    # What the previous stage freed goes back to the system first: glibc keeps it otherwise (the tokenizer's
    # 0.1 GB at a 152k vocabulary), and this stage's peak would carry it.
    release_freed_memory()
    started = _now()
    t0 = time.perf_counter()
    with StagePeak() as memory:
        result = produce() or {}
    seconds = round(time.perf_counter() - t0, 3)
    missing = [str(p) for p in outputs if not p.exists()]
    if missing:
        raise RuntimeError(f"stage {key} finished without writing {', '.join(missing)}")
    recorded_outputs = {p.relative_to(manifest.run_dir).as_posix(): file_records(p) for p in outputs}
    manifest.stages[key] = {
        "input_digest": input_digest,
        "inputs": inputs,
        "settings": settings,
        "outputs": recorded_outputs,
        "result": result,
        "started": started,
        "seconds": seconds,
        "memory": memory.to_json(),
        "host": host_facts(),
    }
    manifest.save()
    return StageResult(key, result, recorded_outputs, False, seconds)


class RunLock:
    """One run per directory: a lock file holding the owner's pid; a lock whose pid is dead is taken over."""

    def __init__(self, run_dir: Path, wait: bool = False, poll_seconds: float = 0.5):
        self.path = run_dir / LOCK_NAME
        self.took_over_from: int | None = None
        self.wait = wait  # release units of one model queue for the directory instead of failing
        self.poll_seconds = poll_seconds

    def __enter__(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self._owner()
                if owner is not None and owner != os.getpid() and _pid_alive(owner) and self.wait:
                    time.sleep(self.poll_seconds)
                    continue
                if owner is not None and owner != os.getpid() and _pid_alive(owner):
                    raise QuantforgeError(
                        f"{self.path.parent} is in use by another quantforge run (pid {owner}); "
                        "wait for it to finish or choose another --out"
                    ) from None
                self.took_over_from = owner
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as handle:
                handle.write(f"{os.getpid()}\n")
            return self

    def _owner(self) -> int | None:
        try:
            return int(self.path.read_text().strip() or 0) or None
        except (OSError, ValueError):
            return None

    def __exit__(self, *exc) -> None:
        if self._owner() == os.getpid():
            self.path.unlink(missing_ok=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_partials(run_dir: Path) -> list[Path]:
    """Remove what killed runs left half-written; return what was removed so the caller can report it."""
    leftovers = find_partials(run_dir)
    for path in leftovers:
        remove_path(path)
    return leftovers

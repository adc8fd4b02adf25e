"""Each artifact is evaluated by a runtime in a process of its own, so that whatever ends that process fails the
format only, as the quantizers' children do (``quantize_process``).

In the build's process, llama.cpp aborting on an assertion, a segmentation fault in a kernel, or the kernel's
out-of-memory killer would end the whole build, and on a GPU an illegal memory access leaves the CUDA context
unusable for every later format. In a child, each of these becomes one line about that format; the child also
takes the runtime's memory (and its CUDA context) with it when the format is done.

Only the runtime moves: the child loads the artifact (``Backend.open_runner``) and turns token windows into
logits; the build keeps scoring them against the reference, so the figures are computed exactly as before. The
logits cross through a memory file both processes map (``LogitsBuffer``), ``SHARED_ROWS`` rows at a time, so each
row is copied once (from the runtime's buffer into the shared one) and never serialized. Requests are JSON lines on the
child's stdin, answers JSON lines on a pipe:

- ``{"op": "logits", "tokens": [...]}``: every position's logits; answered ``{"rows": n, "vocab": v}``.
- ``{"op": "last", "tokens": [...], "rows": k}``: the last ``k`` positions' logits (a task's continuation).
- ``{"op": "scored", "tokens": [...]}``: the scored positions' logits as blocks; each ``{"rows": ...}`` answer is
  followed by ``{"op": "next"}`` for the next block until ``{"end": true}``. Any other request drops the rest.
- an error: ``{"error": ...}`` (``child.error_record``), after which the child ends.

Every answer carries ``peak``: the child's peak resident bytes since its previous answer, less the shared logits
(the build's process holds those pages too, and counts them), so each stage gets the child's peak of its own.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Iterator

import numpy as np

from .child import child_messages, die_with_parent, end_child, error_record, how_it_ended, rebuilt_error, start_child
from .errors import QuantforgeError

WHOSE = "the evaluation runtime's process"
# Rows of logits that cross at a time: a runtime's block is sent in pieces of this many, so the shared memory holds
# 39 MB at a 152k vocabulary where llama.cpp's 256-row block would take 155 MB beside its own two copies.
SHARED_ROWS = 64
CLOSE_WAIT_SECONDS = 10  # an idle child ends at once when its stdin closes; a busy one is killed


def shared_memory_file() -> int:
    """A file descriptor of memory both processes can map: anonymous where Linux offers it (never written to disk,
    not bounded by a small /dev/shm), else an unlinked temporary file."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("quantforge-logits")
    fd, path = tempfile.mkstemp(prefix="quantforge-logits-")
    os.unlink(path)
    return fd


class LogitsBuffer:
    """One block of float32 logits rows in a memory file shared by the build and the runtime's child.

    The child grows the file when a block needs more room; the build maps it again when it sees the file grown.
    A mapping that arrays still view is left for them to free, so a block handed out stays valid until the next is
    written.
    """

    def __init__(self, fd: int):
        self.fd = fd
        self.mapping: mmap.mmap | None = None
        self.size = 0

    def _map(self, size: int) -> None:
        self.mapping, self.size = mmap.mmap(self.fd, size), size

    def write(self, rows: np.ndarray) -> None:
        if not rows.size:
            return
        if rows.nbytes > self.size:
            os.ftruncate(self.fd, rows.nbytes)
            self._map(rows.nbytes)
        np.copyto(self.view(*rows.shape), rows, casting="same_kind")

    def read(self, rows: int, vocab: int) -> np.ndarray:
        if not rows * vocab:
            return np.empty((rows, vocab), dtype=np.float32)
        if rows * vocab * 4 > self.size:
            self._map(os.fstat(self.fd).st_size)
        return self.view(rows, vocab)

    def view(self, rows: int, vocab: int) -> np.ndarray:
        return np.frombuffer(self.mapping, dtype=np.float32, count=rows * vocab).reshape(rows, vocab)


class ChildRunner:
    """A LogitsRunner (``backends.LogitsRunner``) whose runtime runs in a child process: ``logits`` and
    ``scored_logits`` as the runtime's own, each a request to the child. A child that ends without answering
    raises one line saying how it ended; an exception in it comes back as one line."""

    def __init__(
        self,
        backend: str,
        artifact_dir: Path,
        *,
        context: int,
        threads: int,
        device: str,
        log_path: Path,
        kv_cache: str | None = None,
    ):
        self.log_path = log_path
        self.buffer = LogitsBuffer(shared_memory_file())
        try:
            self.process, self.messages = start_child("quantforge.runner_process", pass_fds=(self.buffer.fd,))
        except BaseException:
            os.close(self.buffer.fd)
            raise
        self.busy = False  # a request is out and its answer not yet read
        spec = {"backend": backend, "artifact": str(artifact_dir), "context": context, "threads": threads}
        if kv_cache:
            spec["kv_cache"] = kv_cache
        try:
            self._ask({**spec, "device": device, "buffer_fd": self.buffer.fd})
            ready = self._answer()["ready"]
        except BaseException:
            self.close()
            raise
        self.runtime = ready["runtime"]
        self.flash_attn = ready.get("flash_attn")

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        """Every position's logits for the window, a copy the caller keeps."""
        self._ask({"op": "logits", "tokens": _ids(tokens)})
        return np.array(self._rows())

    def last_logits(self, tokens: np.ndarray, rows: int) -> np.ndarray:
        """The logits of the window's last ``rows`` positions, a copy the caller keeps."""
        self._ask({"op": "last", "tokens": _ids(tokens), "rows": rows})
        return np.array(self._rows())

    def scored_logits(self, tokens: np.ndarray, first: int = 0):
        """The scored positions' logits (from ``first``), a block at a time, each valid until the next is asked for."""
        self._ask({"op": "scored", "tokens": _ids(tokens), "first": first})
        while (rows := self._rows()) is not None:
            yield rows
            del rows
            self._ask({"op": "next"})

    def close(self) -> None:
        """End the child: at once when it is busy (an interrupt, an error while scoring), else when it has seen its
        input close."""
        if self.process.returncode is None:
            try:
                self.process.stdin.close()
            except OSError:
                pass
            if not self.busy:
                try:
                    self.process.wait(timeout=CLOSE_WAIT_SECONDS)
                except Exception:  # noqa: BLE001 - killed below whatever kept it
                    pass
            end_child(self.process)
        self.messages.close()
        if self.buffer.fd >= 0:
            os.close(self.buffer.fd)
            self.buffer.fd = -1

    def _ask(self, request: dict) -> None:
        try:
            self.process.stdin.write((json.dumps(request) + "\n").encode())
            self.process.stdin.flush()
        except (BrokenPipeError, ValueError):  # it has ended: how is told by the answer that never comes
            pass
        self.busy = True

    def _answer(self) -> dict:
        from .memory import note_child_peak

        for line in self.messages:
            try:
                answer = json.loads(line)
            except ValueError:  # a line cut short by the child's end
                continue
            self.busy = False
            if answer.get("peak"):
                note_child_peak(answer["peak"])
            if "error" in answer:
                raise rebuilt_error(answer["error"])
            return answer
        self.busy = False
        self.process.wait()
        raise QuantforgeError(how_it_ended(self.process.returncode, self.log_path, WHOSE))

    def _rows(self) -> np.ndarray | None:
        answer = self._answer()
        return None if answer.get("end") else self.buffer.read(answer["rows"], answer["vocab"])


def _ids(tokens: np.ndarray) -> list[int]:
    return [int(t) for t in tokens]


# -- the child -----------------------------------------------------------------------------------------------------


def _open_runner(spec: dict):
    from .backends import load_backend

    backend = load_backend(spec["backend"])
    if backend.runtime_module == "transformers":
        from .memory import import_transformers_slim

        import_transformers_slim()  # as in the build process: the same modules, and 0.2 GB less
    # a quantized KV cache only where asked: backends without one (kv_cache_types) take no such argument
    options = {"kv_cache": spec["kv_cache"]} if spec.get("kv_cache") else {}
    return backend.open_runner(
        Path(spec["artifact"]), context=spec["context"], threads=spec["threads"], device=spec["device"], **options
    )


def _peak_since_last(buffer: LogitsBuffer) -> int | None:
    """This process's peak resident bytes since the last call, less the shared logits (the build counts those)."""
    from .memory import _high_water_bytes, _reset_high_water

    peak = _high_water_bytes()
    _reset_high_water()
    return max(0, peak - buffer.size) if peak else None


def _pieces(blocks) -> Iterator[np.ndarray]:
    """The rows of ``blocks`` (an array of every row, or consecutive blocks of rows) ``SHARED_ROWS`` at a time; a
    block is cut only while it is valid (the runtime makes the next when the last piece has been taken)."""
    for block in [blocks] if isinstance(blocks, np.ndarray) else blocks:
        for start in range(0, len(block), SHARED_ROWS):
            yield block[start : start + SHARED_ROWS]


def _serve(runner, buffer: LogitsBuffer, send) -> None:
    """Answer requests until stdin closes (see the module's docstring)."""
    from .evaluate import last_logits, scored_logit_blocks

    stream = None  # the blocks of a "scored" request still to come
    for line in sys.stdin:
        request = json.loads(line)
        op = request.get("op")
        if op == "next" and stream is not None:
            rows = next(stream, None)
        else:
            stream = None  # a request other than "next" drops the rest of a stream
            if op == "logits":
                rows = runner.logits(np.asarray(request["tokens"], dtype=np.int32))
            elif op == "last":
                rows = last_logits(runner, np.asarray(request["tokens"], dtype=np.int32), request["rows"])
            elif op == "scored":
                tokens = np.asarray(request["tokens"], dtype=np.int32)
                stream = _pieces(scored_logit_blocks(runner, tokens, request["first"]))
                rows = next(stream, None)
            else:
                raise QuantforgeError(f"the evaluation runtime's process got an unknown request: {line[:80]}")
        if rows is None:
            stream = None
            send({"end": True, "peak": _peak_since_last(buffer)})
            continue
        buffer.write(rows)
        send({"rows": len(rows), "vocab": rows.shape[1], "peak": _peak_since_last(buffer)})
        del rows


def main() -> int:
    die_with_parent()
    # The build's Ctrl-C reaches this process too; the build ends it when it stops, after its own clean-up.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    send = child_messages(int(sys.argv[1]))
    spec = json.loads(sys.stdin.readline())
    buffer = LogitsBuffer(spec["buffer_fd"])
    runner = None
    try:
        runner = _open_runner(spec)
        ready = {"runtime": runner.runtime, "flash_attn": getattr(runner, "flash_attn", None)}
        send({"ready": ready, "peak": _peak_since_last(buffer)})
        _serve(runner, buffer, send)
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the build as one line
        traceback.print_exc()
        sys.stderr.flush()
        send({"error": error_record(exc), "peak": _peak_since_last(buffer)})
        return 1
    finally:
        if runner is not None:
            runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

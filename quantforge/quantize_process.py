"""Each format's quantizer runs in a process of its own, so that whatever ends that process fails the format only.

Inside the build's process a quantizer could take the whole build down with it: GPTQModel 7.6 ends the process
with ``os._exit(1)`` when a task of its worker threads raises (``utils/threadx.py``), a C library can abort or
crash, and the kernel's out-of-memory killer ends the process that grew. In a child, each of these becomes one
line about that format, and the build goes on to the next. The child also takes the quantizer's library and
whatever it kept alive with it when it exits, so later stages of the build never carry them.

The parent (``quantize_in_child``) sends the job as JSON on the child's stdin and reads JSON lines from a pipe
(``child.start_child``): ``{"log": ...}`` for the build's log, then ``{"result": ...}`` or ``{"error": ...}``. The
child's stdout and stderr are the format's log, where the library's output and progress go.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

from .backends import QuantizeJob
from .child import child_messages, die_with_parent, end_child, error_record, how_it_ended, rebuilt_error, start_child
from .errors import QuantforgeError


def job_spec(job: QuantizeJob, backend: str, intermediates: dict[str, Path]) -> dict:
    """What the child needs to rebuild ``job``: plain JSON (the callables become the resolved paths)."""
    return {
        "backend": backend,
        "format": job.format.name,
        "source": job.source.to_json(),
        "settings": job.settings,
        "out": str(job.out),
        "intermediates": {name: str(path) for name, path in intermediates.items()},
        "log_dir": str(job.log_dir),
        "calibration": str(job.calibration) if job.calibration else None,
        "checkpoint_dir": str(job.checkpoint_dir) if job.checkpoint_dir else None,
        "threads": job.threads,
        "device": job.device,
        "dtype": job.dtype,
    }


def job_from_spec(spec: dict, log) -> tuple[object, QuantizeJob]:
    """(backend, job) in the child, from ``job_spec``'s JSON."""
    from .backends import load_backend
    from .source import SourceModel

    backend = load_backend(spec["backend"])
    source = SourceModel(**{**spec["source"], "path": Path(spec["source"]["path"])})
    paths = {name: Path(path) for name, path in spec["intermediates"].items()}

    def intermediate(name: str) -> Path:
        if name not in paths:
            raise QuantforgeError(f"intermediate {name} was not made before the quantize stage that needs it")
        return paths[name]

    optional = lambda value: Path(value) if value else None  # noqa: E731
    job = QuantizeJob(
        source,
        backend.formats[spec["format"]],
        spec["settings"],
        Path(spec["out"]),
        intermediate,
        Path(spec["log_dir"]),
        calibration=optional(spec["calibration"]),
        checkpoint_dir=optional(spec["checkpoint_dir"]),
        threads=spec["threads"],
        device=spec["device"],
        dtype=spec["dtype"],
        log=log,
    )
    return backend, job


def quantize_in_child(job: QuantizeJob, backend: str, intermediates: dict[str, Path], log_path: Path) -> dict:
    """Run ``backend``'s quantize of ``job`` in a child process and return its facts, or raise one line.

    An exception in the child comes back as the same kind of exception (a full disk or exhausted memory still
    stops the build, see failures.is_environment_error); a child that ended without answering, as a
    ``QuantforgeError`` saying how it ended. An interrupt here ends the child before it is passed on, so nothing
    writes into the temporary artifact after the pipeline has removed it.
    """
    from .memory import note_child_peak

    process, messages = start_child("quantforge.quantize_process")
    answer: dict = {}
    try:
        with messages:
            try:
                process.stdin.write(json.dumps(job_spec(job, backend, intermediates)).encode())
                process.stdin.close()
            except BrokenPipeError:  # it ended before reading the job: how it ended is told below
                pass
            for line in messages:
                try:
                    message = json.loads(line)
                except ValueError:  # a line cut short by the child's end
                    continue
                if "log" in message:
                    job.log(message["log"])
                else:
                    answer = message
        process.wait()
    finally:
        end_child(process)
    if answer.get("peak_rss_bytes"):
        # The child's own figure: wait4's ru_maxrss would carry the build's resident size from the fork.
        note_child_peak(answer["peak_rss_bytes"])
    if "result" in answer and process.returncode == 0:
        return answer["result"]
    if "error" in answer:
        raise rebuilt_error(answer["error"])
    raise QuantforgeError(how_it_ended(process.returncode, log_path))


def main() -> int:
    die_with_parent()
    send = child_messages(int(sys.argv[1]))

    from .errors import interrupts_kept
    from .memory import _high_water_bytes, import_transformers_slim

    spec = json.loads(sys.stdin.read())
    try:
        backend, job = job_from_spec(spec, lambda line: send({"log": line}))
        if backend.quantizes_in_transformers:
            import_transformers_slim()  # as in the build process: the same modules, and 0.2 GB less
        with interrupts_kept():
            facts = backend.quantize(job)
    except KeyboardInterrupt:
        return 130
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the build as one line
        traceback.print_exc()
        sys.stderr.flush()
        send({"error": error_record(exc), "peak_rss_bytes": _high_water_bytes()})
        return 1
    send({"result": facts, "peak_rss_bytes": _high_water_bytes()})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The quantizer's child process: how its end is told when it gives no answer, and an error coming back across it.
(A whole build whose quantizers end their process is in test_plugin_backend.py.)"""

from __future__ import annotations

import signal

import pytest

from quantforge.backends import QuantizeJob, load_backend
from quantforge.child import how_it_ended, last_error_line
from quantforge.errors import QuantforgeError
from quantforge.quantize_process import quantize_in_child
from quantforge.source import SourceModel

CHAINED = """loading layer 3
Traceback (most recent call last):
  File "a.py", line 1, in <module>
KeyError: 'first'

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "b.py", line 2, in task
    x @ y
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB
some library's own line after it
"""


def test_the_reason_is_the_last_traceback_line_in_the_log(tmp_path):
    log = tmp_path / "quantize.log"
    log.write_text(CHAINED)
    assert last_error_line(log) == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert how_it_ended(1, log) == (
        "the quantizer's process exited with status 1 before it finished: "
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    )
    log.write_text("no traceback here\n")
    assert how_it_ended(1, log) == "the quantizer's process exited with status 1 before it finished"
    assert how_it_ended(-signal.SIGSEGV, tmp_path / "missing.log") == "the quantizer's process was ended by SIGSEGV"
    assert "most likely by the system for lack of memory" in how_it_ended(-signal.SIGKILL, log)


def test_an_error_in_the_child_comes_back_as_one_line(tiny_llama, tmp_path):
    """llama.cpp's quantizer asked for an F16 GGUF that is not a GGUF: the child's error, not a crash of ours."""
    backend = load_backend("llamacpp")
    bogus = tmp_path / "not.gguf"
    bogus.write_bytes(b"not a gguf file")
    logs = tmp_path / "logs"
    job = QuantizeJob(
        SourceModel("tiny", "local", tiny_llama),
        backend.formats["gguf-q8_0"],
        {},
        tmp_path / "out",
        lambda name: bogus,
        logs,
        threads=1,
    )
    with pytest.raises(QuantforgeError, match=r"^llama\.cpp's quantizer failed \(status \d+\); see "):
        quantize_in_child(job, "llamacpp", {"gguf-f16": bogus}, logs / "quantize.log")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    with pytest.raises(QuantforgeError, match="unknown backend 'no-such-backend'"):
        quantize_in_child(job, "no-such-backend", {}, logs / "quantize.log")


def test_memory_and_disk_errors_in_the_child_still_stop_the_build():
    import errno

    from quantforge.child import error_record, rebuilt_error
    from quantforge.failures import is_environment_error

    for raised in (MemoryError("no room"), OSError(errno.ENOSPC, "No space left on device")):
        rebuilt = rebuilt_error(error_record(raised))
        assert type(rebuilt) is type(raised) and is_environment_error(rebuilt)
    assert type(rebuilt_error(error_record(OSError(errno.ENOENT, "gone")))) is QuantforgeError
    assert str(rebuilt_error(error_record(ValueError("bad shape")))) == "ValueError: bad shape"

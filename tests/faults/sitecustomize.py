"""Makes one library function raise, in the processes of a real build, for the tests of how failures are told.

Put this folder on PYTHONPATH and set QUANTFORGE_TEST_FAULT to ``module:Qualified.name@argv`` or
``module:Qualified.name@argv#caller``: in every process whose command line contains ``argv`` (``quantforge.cli`` for
the build process, ``quantforge.probe_process`` for a speed probe), that function raises ``RuntimeError`` once its
module is imported; with ``#caller``, only when the function calling it has that name (the calibration set's
tokenizer call, not the evaluation text's). Nothing else changes: the build runs the real libraries, and only the
named call fails, as a library's bug or a broken install would make it fail.

QUANTFORGE_TEST_KILL_AFTER, ``module:Qualified.name@argv%N``, instead lets the function run and kills its own process
(SIGKILL, as the system's out-of-memory killer or a power cut would end it) right after its Nth call returns: a
kill at a chosen point of a build, the same on a fast machine and a slow one.
"""

import importlib.abc
import importlib.util
import os
import sys
import types

FAULT = os.environ.get("QUANTFORGE_TEST_FAULT", "")
KILL_AFTER = os.environ.get("QUANTFORGE_TEST_KILL_AFTER", "")


def _killing(module, name, original, calls: int):
    import signal

    made = [0]

    def kill_after(*args, **kwargs):
        result = original(*args, **kwargs)
        made[0] += 1
        if made[0] == calls:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    return kill_after


def _failing(module, name, original, caller: str):
    frame_of = sys._getframe

    def fail(*args, **kwargs):
        if caller and frame_of(1).f_code.co_name != caller:
            return original(*args, **kwargs)
        raise RuntimeError(f"injected failure in {name}")

    # Raised from the library's own module, as its own failure would be (its frame names that module).
    return types.FunctionType(fail.__code__, vars(module), fail.__name__, None, fail.__closure__)


def _patch(module, qualname: str, caller: str) -> None:
    """Replace the function (a class's method too: the replacement takes any arguments) with one that raises, or
    with ``%N`` as ``caller``, one that kills its process after its Nth call."""
    owner_path, _, attribute = qualname.rpartition(".")
    owner = module
    for part in filter(None, owner_path.split(".")):
        owner = getattr(owner, part)
    name = f"{module.__name__}:{qualname}"
    original = getattr(owner, attribute)
    if caller.startswith("%"):
        setattr(owner, attribute, _killing(module, name, original, int(caller[1:])))
    else:
        setattr(owner, attribute, _failing(module, name, original, caller))


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, module_name: str, qualname: str, caller: str):
        self.module_name, self.qualname, self.caller = module_name, qualname, caller

    def find_spec(self, name, path, target=None):
        if name != self.module_name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        loader, qualname, caller = spec.loader, self.qualname, self.caller

        class Patching(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                _patch(module, qualname, caller)

        spec.loader = Patching()
        return spec


if FAULT or KILL_AFTER:
    target, _, where = (FAULT or KILL_AFTER).partition("@")
    where, _, caller_name = where.partition("%" if KILL_AFTER else "#")
    caller_name = f"%{caller_name}" if KILL_AFTER else caller_name
    module_name, _, qualname = target.partition(":")
    if where in " ".join(getattr(sys, "orig_argv", sys.argv)):
        if module_name in sys.modules:
            _patch(sys.modules[module_name], qualname, caller_name)
        else:
            sys.meta_path.insert(0, _PatchOnImport(module_name, qualname, caller_name))

"""OpenMP's waiting: a short spin inside our own processes, the user's own setting where speed is measured.

torch and llama.cpp share one libgomp in a build process (torch's bundled copy, loaded first), which reads
``OMP_WAIT_POLICY`` and ``GOMP_SPINCOUNT`` once, when it loads. llama.cpp's graph code meets an OpenMP barrier after
every node. With libgomp's default a waiting thread spins for 300,000 rounds first, and on cores that something
else keeps busy the spinning threads starve the one they wait for: SmolLM2-135M Q8_0's 512-token windows took
31.7 s each instead of 2.7 s, two threads beside two busy processes on 2 cores (the field notes saw a 44 s
perplexity run pass 12 minutes).

The passive policy that cured that (threads sleep at once) cost 12% on an idle host, where every barrier then
puts a thread to sleep and wakes it: the GGUF evaluation was llama.cpp's own ``llama-perplexity`` plus 11-14%.
A short spin keeps both. Measured on SmolLM2-135M Q8_0 in llama.cpp (512-token windows decoded 256 positions
at a time, 2 threads, 2 cores), seconds a window:
- libgomp's default (spin 300,000): idle 1.12-1.21, one other busy process 3.7-4.1, two 10.9;
- passive: idle 1.23-1.41, one busy 2.2, two 3.5;
- ``GOMP_SPINCOUNT=1000``: idle 1.12, one busy 2.3, two 2.4.
(Idle: eight windows in 9.0 s against 10.8 s passive.) So our own processes spin 1000 rounds unless the
user chose a policy or a spin count; torch's reference forward ran 2-7% faster with it too.

The speed probe must not inherit that choice. A probe times llama.cpp as its users run it: with libgomp's
default, which is what llama.cpp's own tools, Ollama and every user who sets nothing get (a passive barrier cost
SmolLM2's decode 67-76 tok/s against 110-119). So a probe runs with the environment the user gave us, and its
figure records the policy it ran under.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

WAIT_POLICY = "OMP_WAIT_POLICY"
SPIN_COUNT = "GOMP_SPINCOUNT"
OUR_SPIN_COUNT = "1000"
OURS = "QUANTFORGE_SET_GOMP_SPINCOUNT"  # present while GOMP_SPINCOUNT holds our setting, not the user's
DEFAULT = "default"  # how a figure records that the policy was left to libgomp


def wait_briefly() -> None:
    """Make OpenMP threads spin only briefly before they sleep, unless the user set a policy or a spin count. Call
    it before torch or llama.cpp is imported: libgomp reads the setting when it loads."""
    if WAIT_POLICY not in os.environ and SPIN_COUNT not in os.environ:
        os.environ[SPIN_COUNT] = OUR_SPIN_COUNT
        os.environ[OURS] = "1"


def users_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment as the user gave it to us, for a process that times a runtime as its users run it."""
    environ = dict(os.environ if environ is None else environ)
    if environ.pop(OURS, None) is not None:
        environ.pop(SPIN_COUNT, None)
    return environ


def wait_policy(environ: Mapping[str, str] | None = None) -> str:
    """The policy a process started with ``environ`` runs under, as a figure records it."""
    environ = os.environ if environ is None else environ
    policy = environ.get(WAIT_POLICY) or DEFAULT
    spin = environ.get(SPIN_COUNT)
    return f"{policy}, {SPIN_COUNT}={spin}" if spin else policy

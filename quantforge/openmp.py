"""OpenMP's wait policy: passive inside our own processes, the user's own where speed is measured.

torch and llama.cpp share one libgomp in a build process (torch's bundled copy, loaded first), which reads
``OMP_WAIT_POLICY`` once, when it loads. llama.cpp's graph code meets an OpenMP barrier after every node. With
libgomp's default policy a waiting thread spins first, and on cores that something else keeps busy the spinning
threads starve the one they wait for: SmolLM2-135M Q8_0's 512-token windows took 31.7 s each instead of 2.7 s
with the passive policy, two threads beside two busy processes on 2 cores (the field notes saw a 44 s perplexity
run pass 12 minutes). So our own processes wait passively unless the user chose a policy.

The speed probe must not inherit that choice. A passive barrier puts the threads to sleep at every node, which
costs a decode step far more than a batch: on an idle host SmolLM2-135M decoded 67-76 tok/s in llama.cpp with
the passive policy against 110-119 tok/s with libgomp's default (Q8_0 and Q4_K_M, 2 threads), and 23 against
29-30 tok/s in transformers. The default is what llama.cpp's own tools, Ollama and every user who sets nothing
get. So a probe runs with the environment the user gave us, and its figure records the policy it ran under.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

WAIT_POLICY = "OMP_WAIT_POLICY"
OURS = "QUANTFORGE_SET_OMP_WAIT_POLICY"  # present while OMP_WAIT_POLICY holds our setting, not the user's
DEFAULT = "default"  # how a figure records that the policy was left to libgomp


def wait_passively() -> None:
    """Make OpenMP threads sleep while they wait, unless the user set a policy. Call it before torch or llama.cpp
    is imported: libgomp reads the setting when it loads."""
    if WAIT_POLICY not in os.environ:
        os.environ[WAIT_POLICY] = "PASSIVE"
        os.environ[OURS] = "1"


def users_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment as the user gave it to us, for a process that times a runtime as its users run it."""
    environ = dict(os.environ if environ is None else environ)
    if environ.pop(OURS, None) is not None:
        environ.pop(WAIT_POLICY, None)
    return environ


def wait_policy(environ: Mapping[str, str] | None = None) -> str:
    """The policy a process started with ``environ`` runs under, as a figure records it."""
    environ = os.environ if environ is None else environ
    return environ.get(WAIT_POLICY) or DEFAULT

"""The speed probe's process: times one artifact in its runtime (probe.py's probes, or the probe of the backend that
made it), or measures the host's memory bandwidth, and prints JSON. A process of its own, so that its peak memory
is the model's and not the build's; the build starts it as ``python -m quantforge.probe_process``."""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
from pathlib import Path

import numpy as np

from .backends import load_backend
from .openmp import wait_policy
from .probe import PROBES, measure_bandwidth, peak_rss_mb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Decode-speed probe of one artifact, or the host's bandwidth (JSON)")
    parser.add_argument(
        "--runtime",
        help=f"the runtime to time the artifact in ({', '.join(sorted(PROBES))}, or one the --backend knows)",
    )
    parser.add_argument("--backend", help="the backend that made the artifact; its probe() runs it (default: ours)")
    parser.add_argument("--path", type=Path)
    parser.add_argument("--prompt", type=Path, help=".npy file of prompt token ids")
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu or cuda:N, as the build resolved --device")
    parser.add_argument("--bandwidth", action="store_true", help="measure the host's memory bandwidth instead")
    parser.add_argument("--buffer-bytes", type=int, help="bytes per array of the bandwidth copy")
    args = parser.parse_args(argv)
    if args.bandwidth:  # a child of the build, so the buffers never count against the build's own memory
        print(json.dumps({"bandwidth_gbs": measure_bandwidth(args.threads, buffer_bytes=args.buffer_bytes)}))
        return 0
    if not (args.runtime and args.path and args.prompt):
        parser.error("--runtime, --path and --prompt are needed for a speed probe")
    if not args.backend and args.runtime not in PROBES:
        parser.error(f"--runtime must be one of {', '.join(sorted(PROBES))} without --backend")
    prompt = [int(t) for t in np.load(args.prompt)]
    if args.backend:
        backend = load_backend(args.backend)
        # A third-party backend's probe may predate the device: it is then left to choose its own.
        where = {"device": args.device} if "device" in inspect.signature(backend.probe).parameters else {}
        result = backend.probe(args.runtime, args.path, prompt, args.gen_tokens, args.threads, args.runs, **where)
    else:
        result = PROBES[args.runtime](args.path, prompt, args.gen_tokens, args.threads, args.runs, args.device)
    result["peak_rss_mb"] = peak_rss_mb()
    result["omp_wait_policy"] = wait_policy()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How a build's cost grows with the model: the same GGUF build on SmolLM2-135M and Qwen2.5-Coder-0.5B.

For each model it prints, per stage, the predicted (``build --plan-only``) and measured seconds and peak resident
memory (from the run's manifest), then the ratio of quantforge's GGUF path (convert + quantize + evaluate) to
llama.cpp's own tools on the same files and threads (``convert_hf_to_gguf.py``, ``llama-quantize``,
``llama-perplexity`` over the same number of windows of the same length, flash attention off as quantforge
evaluates). With ``--scoring second-half`` (the default) both score the same positions: quantforge builds with
``--ppl-scoring second-half`` and llama-perplexity runs as it does by default. With ``--scoring all``, quantforge's
default convention against llama-perplexity's strided mode, which also scores every token of the text
(``--ppl-stride``), but in windows of its own: it widens them (``-c 128 --ppl-stride 127`` reported a calculation
chunk of 256), so its perplexity is lower than quantforge's and the timing compares like work only roughly.
quantforge also compares every scored position with the reference (KL divergence,
top-1), which llama-perplexity does not. Each format's perplexity is printed from both: under second-half scoring
they read the same windows of the same tokens (for a model without BOS), so they should agree to rounding.
Goals (issue 12): GGUF path <= 1.1x llama.cpp's tools; peak RSS <= 1.5x the bf16 weights (also printed beyond the
build process's footprint before any model, its `tokens` stage); time growing no faster than the parameter count.

Equal work, equal environment: llama.cpp's tools run with the OpenMP spin quantforge's own processes use
(``quantforge.openmp.wait_briefly``: GOMP_SPINCOUNT=1000 unless the caller set a policy), and quantforge's side
counts its tokenization (the ``tokens`` stage), as llama-perplexity's time includes its own. With ``--repeat N`` both
sides run N times, interleaved (quantforge's build, then llama.cpp's tools), and the ratio reported is the median of
the N rounds' own ratios (on a shared host llama.cpp's tools alone varied by 25% between runs). Per-stage tables
show each stage's median time and highest memory.

    .venv/bin/python scripts/bench_scale.py [--models smollm2-135m,qwen2.5-coder-0.5b] [--windows 8] [--repeat 1]
        [--scoring second-half|all]

With ``--shapes-7b`` it instead builds the README headline command's GGUF half (``--formats gguf-q4km``, few
windows, the speed probe on) on a random-weight model with Qwen2.5-7B's real shapes at full depth (28 layers,
7.6B parameters, tests/real_shapes.py), and prints each stage's measured time and peak beside the plan. It writes
about 35 GB (the 15 GB checkpoint, its F16 GGUF, the Q4_K_M file) under ``--work`` and removes them after.

    .venv/bin/python scripts/bench_scale.py --shapes-7b [--work DIR] [--windows 2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from llamacpp_tools import tool  # noqa: E402

from quantforge.resources import plan_versus_actual  # noqa: E402

QUANTFORGE = [sys.executable, "-m", "quantforge.cli"]
FORMATS = {"gguf-q8_0": "Q8_0", "gguf-q4km": "Q4_K_M"}


def timed(command: list[str], log: Path | None = None, **kwargs) -> tuple[float, int]:
    """Wall seconds and the child's peak RSS (bytes) of one command (its output to ``log`` when given)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    with open(log or os.devnull, "w") as output:
        subprocess.run(command, check=True, stdout=output, stderr=subprocess.STDOUT, **kwargs)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return seconds, (after * 1024 if after > before else None)


def build_args(model: str, out: Path, context: int, windows: int, threads: int, scoring: str) -> list[str]:
    return [
        "build", model, "--formats", ",".join(FORMATS), "--out", str(out), "--no-speed",
        "--ppl-context", str(context), "--ppl-windows", str(windows), "--threads", str(threads),
        "--ppl-scoring", scoring,
    ]  # fmt: skip


def our_run(model: str, out: Path, context: int, windows: int, threads: int, scoring: str) -> dict:
    args = build_args(model, out, context, windows, threads, scoring)
    plan = json.loads(subprocess.run(QUANTFORGE + args + ["--plan-only", "--json"], capture_output=True,
                                     text=True, check=True).stdout)  # fmt: skip
    seconds, _ = timed(QUANTFORGE + args)
    manifest = json.loads((out / "run.json").read_text())
    return {"plan": plan, "wall_seconds": seconds, "stages": manifest["stages"], "run": manifest}


def same_openmp_environment() -> dict[str, str]:
    """The environment quantforge's own processes run with (its short OpenMP spin), for llama.cpp's tools too."""
    from quantforge.openmp import wait_briefly

    wait_briefly()  # sets GOMP_SPINCOUNT in this process's environment unless a policy was chosen
    return dict(os.environ)


def their_run(
    source: Path, text: Path, out: Path, context: int, windows: int, threads: int, scoring: str
) -> tuple[dict, dict]:
    """llama.cpp's own tools on the same model folder, text and windows, scoring the positions quantforge scores,
    in the same OpenMP environment: each step's seconds and peak memory, and each format's perplexity as
    llama-perplexity printed it."""
    from quantforge.backends.llamacpp.convert import find_converter

    f16 = out / "model-f16.gguf"
    converter = find_converter()
    same = same_openmp_environment()
    env = {**same, "PYTHONPATH": str(converter / "gguf-py")}
    convert = [sys.executable, str(converter / "convert_hf_to_gguf.py"), str(source), "--outtype", "f16",
               "--outfile", str(f16)]  # fmt: skip
    results, perplexities = {"convert": timed(convert, env=env)}, {}
    for key, file_type in FORMATS.items():
        quantized = out / f"{key}.gguf"
        results[f"quantize/{key}"] = timed([str(tool("llama-quantize")), str(f16), str(quantized), file_type,
                                            str(threads)], env=same)  # fmt: skip
        perplexity = [str(tool("llama-perplexity")), "-m", str(quantized), "-f", str(text), "-c", str(context),
                      "-b", str(context), "--chunks", str(windows), "-t", str(threads), "-fa", "off"]  # fmt: skip
        if scoring == "all":
            # Its strided mode scores every token of the text once, in windows it widens itself (see above).
            perplexity += ["--ppl-stride", str(context - 1)]
        log = out / f"perplexity-{key}.log"
        results[f"evaluate/{key}"] = timed(perplexity, log=log, env=same)
        perplexities[key] = final_perplexity(log.read_text(errors="replace"))
    return {key: {"seconds": s, "peak_rss_bytes": m} for key, (s, m) in results.items()}, perplexities


def final_perplexity(output: str) -> float | None:
    """llama-perplexity's final estimate from its output (None when it printed none). Its strided mode prints no
    final line, only the running estimate after each window ("[1]58.3391,[2]39.4362,"): the last is the final."""
    found = re.findall(r"Final estimate: PPL = ([0-9.]+)", output) or re.findall(r"\[\d+\]([0-9.]+),", output)
    return float(found[-1]) if found else None


def median_of(ours_runs: list[dict], theirs_runs: list[dict]) -> tuple[dict, dict]:
    """One run of each side from several, for the per-stage tables: each stage's median time and highest memory."""
    import statistics

    ours = {**ours_runs[0], "wall_seconds": statistics.median(run["wall_seconds"] for run in ours_runs), "stages": {}}
    for key, record in ours_runs[0]["stages"].items():
        records = [run["stages"][key] for run in ours_runs]
        peaks = [r["memory"]["peak_rss_bytes"] or 0 for r in records]
        children = [r["memory"].get("child_peak_rss_bytes") or 0 for r in records]
        hosts = [r["memory"].get("host_peak_rss_bytes") or 0 for r in records]  # a quantizer's child and the build
        memory = {"peak_rss_bytes": max(peaks) or None, "child_peak_rss_bytes": max(children) or None}
        if max(hosts):
            memory["host_peak_rss_bytes"] = max(hosts)
        seconds = statistics.median(r["seconds"] for r in records)
        ours["stages"][key] = {**record, "seconds": seconds, "memory": memory}
    theirs = {}
    for key in theirs_runs[0]:
        peaks = [run[key]["peak_rss_bytes"] or 0 for run in theirs_runs]
        seconds = statistics.median(run[key]["seconds"] for run in theirs_runs)
        theirs[key] = {"seconds": seconds, "peak_rss_bytes": max(peaks) or None}
    return ours, theirs


def gguf_path_ratio(ours: dict, theirs: dict, perplexities: dict) -> dict:
    stages = ours["stages"]
    # the tokens stage too: llama-perplexity's time includes its tokenizing the text
    ours_seconds = (
        stages["tokens"]["seconds"]
        + stages["intermediate/gguf-f16"]["seconds"]
        + sum(stages[f"{stage}/{key}"]["seconds"] for key in FORMATS for stage in ("quantize", "evaluate"))
    )
    theirs_seconds = sum(v["seconds"] for v in theirs.values())
    ours_eval = sum(stages[f"evaluate/{key}"]["seconds"] for key in FORMATS)
    theirs_eval = sum(theirs[f"evaluate/{key}"]["seconds"] for key in FORMATS)
    return {"ours_seconds": round(ours_seconds, 1), "llamacpp_seconds": round(theirs_seconds, 1),
            "ratio": round(ours_seconds / theirs_seconds, 3),
            "evaluate_ratio": round(ours_eval / theirs_eval, 3),
            "perplexity": {key: {"quantforge": round(stages[f"evaluate/{key}"]["result"]["perplexity"], 4),
                                 "llama-perplexity": perplexities[key]} for key in FORMATS}}  # fmt: skip


def evaluation_text(run: dict, out: Path) -> Path:
    """The run's evaluation text as a file llama-perplexity reads (the same text quantforge tokenized)."""
    from quantforge.textdata import load_text

    path = out / "eval.txt"
    path.write_text(load_text(run["plan"]["eval_settings"]["text"]).joined)
    return path


def _median(values: list[float]) -> float:
    import statistics

    return round(statistics.median(values), 3)


def print_model(name: str, model: dict) -> None:
    print(f"\n{name}: {model['parameters'] / 1e6:.0f}M parameters, build {model['wall_seconds']:.0f} s "
          f"(predicted {model['predicted_seconds']:.0f} s)", flush=True)  # fmt: skip
    print(f"  {'stage':28} {'pred s':>8} {'s':>8} {'ratio':>6} {'pred GB':>8} {'GB':>6} {'ratio':>6}")
    for row in model["stages"]:
        gb = (row["peak_rss_bytes"] or 0) / 1e9
        print(f"  {row['key']:28} {row['predicted_seconds']:8.1f} {row['seconds']:8.1f} {row['time_ratio']!s:>6} "
              f"{row['predicted_peak_rss_bytes'] / 1e9:8.2f} {gb:6.2f} {row['memory_ratio']!s:>6}")  # fmt: skip
    gguf = model["gguf_path"]
    print(f"  peak RSS {model['peak_rss_bytes'] / 1e9:.2f} GB = {model['peak_over_bf16']}x bf16 weights; "
          f"beyond the process before any model ({model['baseline_rss_bytes'] / 1e9:.2f} GB) "
          f"{model['peak_beyond_baseline_over_bf16']}x (goal <= 1.5x)")  # fmt: skip
    print(f"  GGUF path, scoring {model['scoring']} in both: quantforge {gguf['ours_seconds']} s, llama.cpp tools "
          f"{gguf['llamacpp_seconds']} s, ratio {gguf['ratio']} (goal <= 1.1); evaluation alone "
          f"{gguf['evaluate_ratio']}", flush=True)  # fmt: skip
    if len(gguf["ratio_each_round"]) > 1:
        print(f"  (the median of {len(gguf['ratio_each_round'])} rounds' own ratios: "
              f"{', '.join(str(r) for r in gguf['ratio_each_round'])}; stage times are medians)")  # fmt: skip
    for key, figures in gguf["perplexity"].items():
        print(f"  perplexity {key}: quantforge {figures['quantforge']}, llama-perplexity {figures['llama-perplexity']}")


def shapes_7b(work: Path, windows: int, threads: int, as_json: bool) -> dict:
    """The headline command's GGUF half on a full-depth, random-weight Qwen2.5-7B shape: stages against the plan."""
    import shutil

    sys.path.insert(0, str(ROOT / "tests"))
    from real_shapes import write_random_model  # noqa: E402

    work.mkdir(parents=True, exist_ok=True)
    model, out = work / "qwen2.5-7b-shaped", work / "run"
    try:
        started = time.perf_counter()
        write_random_model("qwen2.5-7b", model, layers=28)
        written = time.perf_counter() - started
        args = ["build", str(model), "--formats", "gguf-q4km", "--out", str(out), "--ppl-windows", str(windows),
                "--threads", str(threads)]  # fmt: skip
        plan = json.loads(subprocess.run(QUANTFORGE + args + ["--plan-only", "--json"], capture_output=True,
                                         text=True, check=True).stdout)  # fmt: skip
        seconds, _ = timed(QUANTFORGE + args, log=work / "build.log")
        manifest = json.loads((out / "run.json").read_text())
        stages = plan_versus_actual(plan, manifest["stages"])
        report = {"parameters": plan["model"]["parameters"], "model_written_seconds": round(written, 1),
                  "wall_seconds": round(seconds, 1), "predicted_seconds": plan["total"]["seconds"],
                  "predicted_peak_rss_bytes": plan["total"]["peak_rss_bytes"], "stages": stages,
                  # each stage's build-process and child peaks, to tell which side of a stage outgrew its plan
                  "memory": {key: record.get("memory") for key, record in manifest["stages"].items()}}  # fmt: skip
    finally:
        shutil.rmtree(model, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    if not as_json:
        print(f"Qwen2.5-7B shape, random weights, 28 layers: {report['parameters'] / 1e9:.2f}B parameters "
              f"(written in {written:.0f} s); build {seconds / 60:.1f} min, predicted "
              f"{report['predicted_seconds'] / 60:.1f} min")  # fmt: skip
        print(f"  {'stage':28} {'pred s':>8} {'s':>8} {'ratio':>6} {'pred GB':>8} {'GB':>6} {'ratio':>6}")
        for row in stages:
            gb = (row["peak_rss_bytes"] or 0) / 1e9
            print(f"  {row['key']:28} {row['predicted_seconds']:8.1f} {row['seconds'] or 0:8.1f} "
                  f"{row['time_ratio']!s:>6} {row['predicted_peak_rss_bytes'] / 1e9:8.2f} {gb:6.2f} "
                  f"{row['memory_ratio']!s:>6}", flush=True)  # fmt: skip
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes-7b", action="store_true", help="the 7B-shaped GGUF build instead (see above)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "bench-scale-7b",
                        help="with --shapes-7b: where its 35 GB go")  # fmt: skip
    parser.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--repeat", type=int, default=1, help="run both sides this many times, interleaved")
    parser.add_argument("--scoring", choices=("second-half", "all"), default="second-half",
                        help="the positions both sides score (see above)")  # fmt: skip
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--save", type=Path, help="also write the report as JSON to this file")
    args = parser.parse_args()
    if args.shapes_7b:
        report = shapes_7b(args.work, args.windows if args.windows != 8 else 2, args.threads, args.json)
        if args.save:
            args.save.write_text(json.dumps(report, indent=2))
        if args.json:
            print(json.dumps(report, indent=2))
        return 0
    report = {"models": {}}
    for model in args.models.split(","):
        ours_runs, theirs_runs = [], []
        for _ in range(max(1, args.repeat)):
            with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
                work = Path(tmp)
                settings = (args.context, args.windows, args.threads, args.scoring)
                ours_runs.append(our_run(model, work / "run", *settings))
                source = Path(ours_runs[-1]["run"]["stages"]["fetch"]["result"]["path"])
                text = evaluation_text(ours_runs[-1]["run"], work)
                timings, perplexities = their_run(source, text, work, *settings)  # the same perplexity every round
                theirs_runs.append(timings)
        rounds = [gguf_path_ratio(o, t, perplexities) for o, t in zip(ours_runs, theirs_runs, strict=True)]
        ours, theirs = median_of(ours_runs, theirs_runs)
        parameters = ours["plan"]["model"]["parameters"]
        # The build process before any model is in memory: libraries imported, tokenizer loaded (the lowest of the
        # rounds, as the peak is their highest).
        baseline = min(run["stages"]["tokens"]["memory"]["peak_rss_bytes"] for run in ours_runs)
        bf16 = 2 * parameters
        stages = plan_versus_actual(ours["plan"], ours["stages"])
        peak = max(row["peak_rss_bytes"] or 0 for row in stages)  # a stage's own, its child's, or both
        report["models"][model] = {
            "parameters": parameters,
            "wall_seconds": round(ours["wall_seconds"], 1),
            "predicted_seconds": ours["plan"]["total"]["seconds"],
            "peak_rss_bytes": peak,
            "peak_over_bf16": round(peak / bf16, 2),
            "baseline_rss_bytes": baseline,
            "peak_beyond_baseline_over_bf16": round((peak - baseline) / bf16, 2),
            "scoring": args.scoring,
            "gguf_path": {
                **gguf_path_ratio(ours, theirs, perplexities),
                # the headline: the median of each round's own ratio (both sides of a round ran back to back)
                "ratio": _median([r["ratio"] for r in rounds]),
                "evaluate_ratio": _median([r["evaluate_ratio"] for r in rounds]),
                "ratio_each_round": [r["ratio"] for r in rounds],
            },
            "stages": stages,
            "llamacpp": theirs,
        }
        if not args.json:
            print_model(model, report["models"][model])
    names = list(report["models"])
    if len(names) == 2:
        small, large = (report["models"][n] for n in names)
        report["growth"] = {
            "parameters": round(large["parameters"] / small["parameters"], 2),
            "seconds": round(large["wall_seconds"] / small["wall_seconds"], 2),
        }
    if args.save:
        args.save.write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    if "growth" in report:
        growth = report["growth"]
        print(
            f"\ngrowth: parameters x{growth['parameters']}, build time x{growth['seconds']} (goal: time <= parameters)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

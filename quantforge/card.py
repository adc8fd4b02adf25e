"""The comparison card: built from the run manifest alone, so ``quantforge card RUN_DIR`` re-decides in a second.

card.json (schema ``quantforge.card/1``):
    model        source facts (name, origin, Hub id and revision, architecture, parameters)
    evaluation   text (name, source, sha256), context, windows, tokens scored, scoring convention
    reference    the unquantized model's measurements
    formats[]    key, format, scheme, backend, family, runtimes, artifact, size_bytes, bits_per_weight,
                 metrics (perplexity, perplexity_increase_pct, kld_mean, top1_agreement,
                 task_recovery_pct, task_recovery_pct[TASK], decode_tps, gpu_needed_gb), tasks (per task: metric,
                 value, stderr, samples, recovery_pct), speed (probe and roofline), memory_fit (per GPU),
                 how (runtime, threads, seconds), quantize facts (fallbacks, tensor types, group size)
    pareto_front keys of the formats no other format beats on both size and KL divergence
    host         this host's measured memory bandwidth
    targets      the targets the decision used
    decision     recommended, verdicts[] (key, outcome, reason, checks), best_per_family, closest
    provenance   quantforge version, host, per-stage timings and input digests
"""

from __future__ import annotations

from pathlib import Path

from . import __version__
from .decide import Candidate, Targets, decide, pareto_front
from .errors import QuantforgeError
from .evaluate import EvalSettings
from .fsutil import atomic_write_json, atomic_write_text
from .manifest import Manifest
from .markdown import bos_convention, render_markdown
from .rundir import (
    CALIBRATION,
    CARD_JSON,
    CARD_MARKDOWN,
    FETCH,
    HOST,
    MANIFEST_NAME,
    REFERENCE,
    TOKENS,
    evaluate_stage,
    kv_cache_stage,
    quantize_stage,
    speed_stage,
    tasks_stage,
)

CARD_SCHEMA = "quantforge.card/1"


def convention(scoring: str, context: int, windows: int) -> str:
    """What the perplexity windows were, in words a reader can compare with other tools' figures."""
    if scoring == "second-half":
        return (
            f"llama-perplexity's convention: the text file tokenized once, cut every {context} tokens (BOS first "
            f"where the model's tokenizer adds it, overwriting the cut's first token, as llama-perplexity does), "
            f"the second half of each of the first {windows} windows scored"
        )
    return (
        f"the first {windows} non-overlapping windows of {context} tokens of the text joined and tokenized once, "
        "every position after each window's first scored: GPTQ's and AutoRound's way of scoring, on a part of "
        "the text (their papers score 2048-token windows over all of it: --ppl-context 2048 and enough windows)"
    )


def _task_results(manifest: Manifest, key: str) -> dict:
    names = (manifest.data.get("plan", {}).get("tasks") or {}).get("names") or []
    found = {}
    for name in names:
        stage = manifest.stage(tasks_stage(key, name))
        if stage:
            found[name] = stage["result"]
    return found


def _with_recovery(results: dict, reference: dict) -> tuple[dict, float | None]:
    """Per-task accuracy with recovery against the reference (same task, same limit), and their mean."""
    tasks = {}
    for name, result in results.items():
        base = reference.get(name)
        recovery = 100.0 * result["value"] / base["value"] if base and base["value"] else None
        tasks[name] = {
            "metric": result["metric"],
            "value": result["value"],
            "stderr": result["stderr"],
            "samples": result["samples"],
            "recovery_pct": recovery,
        }
    recoveries = [t["recovery_pct"] for t in tasks.values() if t["recovery_pct"] is not None]
    complete = reference and len(recoveries) == len(reference)
    return tasks, (sum(recoveries) / len(recoveries) if recoveries and complete else None)


def _intervals(result: dict, tasks: dict, reference_tasks: dict) -> dict:
    """metric -> 95% interval (see uncertainty.py): Student's t over the perplexity windows' paired figures, and
    the delta method on each task's standard errors. Empty for a run evaluated before intervals were recorded."""
    from .uncertainty import mean_recovery_interval, recovery_interval, window_intervals

    intervals = window_intervals(result["per_window"]) if result.get("per_window") else {}
    task_intervals = []
    for name, task in tasks.items():
        base = reference_tasks.get(name)
        interval = base and recovery_interval(
            task["value"], task["stderr"], base["value"], base.get("stderr"), task["samples"]
        )
        if interval:
            intervals[f"task_recovery_pct[{name}]"] = interval
            task_intervals.append(interval)
    if task_intervals and len(task_intervals) == len(reference_tasks):
        intervals["task_recovery_pct"] = mean_recovery_interval(task_intervals)
    return intervals


def _format_entries(manifest: Manifest) -> list[dict]:
    plan = manifest.data.get("plan", {})
    reference = manifest.stage(REFERENCE)["result"]
    reference_tasks = _task_results(manifest, "reference")
    entries = []
    for key, info in plan.get("artifacts", {}).items():
        quantized = manifest.stage(quantize_stage(key))
        evaluated = manifest.stage(evaluate_stage(key))
        entry = {**info, "key": key, "complete": bool(quantized and evaluated)}
        if quantized:
            facts = quantized["result"]
            entry.update(
                artifact=next(iter(quantized["outputs"])),
                size_bytes=facts["size_bytes"],
                bits_per_weight=facts["bits_per_weight"],
                quantize={k: v for k, v in facts.items() if k not in ("size_bytes", "bits_per_weight")},
                quantize_seconds=quantized["seconds"],
            )
            # A runtime the made files do not load in (the quantizer's own layout) is off the entry's list, with why.
            refused = facts.get("not_runtimes") or {}
            entry["runtimes"] = [runtime for runtime in entry["runtimes"] if runtime not in refused]
        if evaluated:
            result = evaluated["result"]
            metrics = {
                k: result[k]
                for k in (
                    "perplexity",
                    "perplexity_stderr",
                    "kld_mean",
                    "top1_agreement",
                    "tokens_scored",
                )
                if k in result
            }
            metrics["perplexity_increase_pct"] = 100.0 * (result["perplexity"] / reference["perplexity"] - 1.0)
            tasks, mean_recovery = _with_recovery(_task_results(manifest, key), reference_tasks)
            if tasks:
                entry["tasks"] = tasks
            if mean_recovery is not None:
                metrics["task_recovery_pct"] = mean_recovery
            for name, task in tasks.items():
                if task["recovery_pct"] is not None:
                    metrics[f"task_recovery_pct[{name}]"] = task["recovery_pct"]
            entry["metrics"] = metrics
            entry["intervals"] = _intervals(result, tasks, reference_tasks)
            if result.get("per_window"):
                entry["per_window"] = result["per_window"]  # what the intervals resample; run-to-run checks use it
            entry["how"] = {
                k: result.get(k) for k in ("runtime", "threads", "flash_attn", "eval_seconds", "eval_tokens_per_second")
            }
        if evaluated:
            kv_caches = _kv_cache_results(manifest, key, evaluated["result"], reference)
            if kv_caches:
                entry["kv_cache"] = kv_caches
        speed = manifest.stage(speed_stage(key))
        if speed:
            entry["speed"] = speed["result"]
            if speed["result"].get("measured") and "metrics" in entry:
                entry["metrics"]["decode_tps"] = speed["result"]["decode_tps"]
        entries.append(entry)
    return entries


def _kv_cache_results(manifest: Manifest, key: str, own: dict, reference: dict) -> dict:
    """type -> the file's figures with that quantized KV cache (same windows, flash attention on), and its mean KL
    as a multiple of the file's own with the 16-bit cache (a paired interval over the windows)."""
    from .uncertainty import kld_ratio_interval, window_intervals

    found = {}
    prefix = kv_cache_stage(key)
    for stage_key, record in manifest.stages.items():
        if not stage_key.startswith(prefix):
            continue
        result = record["result"]
        figures = {k: result[k] for k in ("perplexity", "kld_mean", "top1_agreement") if k in result}
        figures["perplexity_increase_pct"] = 100.0 * (result["perplexity"] / reference["perplexity"] - 1.0)
        kv = {
            "metrics": figures,
            "intervals": window_intervals(result["per_window"]) if result.get("per_window") else {},
            "flash_attn": result.get("flash_attn"),
            "runtime": result.get("runtime"),
            "bytes_per_value": result.get("kv_bytes_per_value"),
        }
        if own.get("kld_mean"):
            kv["kld_ratio"] = result["kld_mean"] / own["kld_mean"]
        if result.get("per_window") and own.get("per_window"):
            kv["kld_ratio_interval"] = kld_ratio_interval(result["per_window"], own["per_window"])
        found[stage_key[len(prefix) :]] = kv
    return found


def _quantized_kv(entry: dict) -> tuple[str, float]:
    """The quantized KV cache the memory fit may fall back to: the least aggressive one measured for this file
    (--kv-cache), else its runtime's usual one: llama.cpp's q8_0 for a GGUF, vLLM's fp8 for the others."""
    from .deploy import FP8_KV_BYTES

    measured = {name: kv["bytes_per_value"] for name, kv in (entry.get("kv_cache") or {}).items()}
    if measured:
        name = max(measured, key=measured.__getitem__)
        return name, measured[name]
    if entry["family"] == "gguf":
        from .backends.llamacpp import KV_CACHE_BYTES

        return "q8_0", KV_CACHE_BYTES["q8_0"]
    return "fp8", FP8_KV_BYTES


def _add_memory_fit(entries: list[dict], config: dict, targets: Targets) -> float | None:
    """Each format's fit on the target GPU (or on every GPU of the table); returns the usable GB when --gpu."""
    from .deploy import memory_fit, parse_gpu
    from .gpus import GPUS

    gpus = [parse_gpu(targets.gpu)] if targets.gpu else [parse_gpu(name) for name in GPUS]
    usable = None
    for entry in entries:
        if "tensor_bytes" not in (entry.get("quantize") or {}):
            continue
        weight_bytes = entry["quantize"]["tensor_bytes"]
        kv = _quantized_kv(entry)
        fits = {
            gpu.name: memory_fit(weight_bytes, config, gpu, targets.context, targets.concurrency, kv) for gpu in gpus
        }
        entry["memory_fit"] = fits
        if targets.gpu and "metrics" in entry:
            only = next(iter(fits.values()))
            entry["metrics"]["gpu_needed_gb"] = only["needed_gb"]
            usable = only["usable_gb"]
    return usable


def _gpu(targets: Targets) -> tuple[str, str] | None:
    """The target GPU's name and generation, for a GPU of the table (a size such as 20GB has none)."""
    from .deploy import parse_gpu
    from .gpus import GENERATION

    if not targets.gpu:
        return None
    name = parse_gpu(targets.gpu).name
    return (name, GENERATION[name]) if name in GENERATION else None


def build_card(run_dir: Path, targets: Targets) -> dict:
    manifest = Manifest.open(run_dir)
    if not manifest.path.exists() or "plan" not in manifest.data:
        raise QuantforgeError(f"{run_dir} holds no quantforge run ({MANIFEST_NAME} is missing); run 'quantforge build'")
    if not manifest.stage(REFERENCE):
        command = manifest.data["plan"].get("command", "quantforge build ...")
        raise QuantforgeError(f"{run_dir} is unfinished: the reference was not evaluated; rerun: {command}")
    from .backends import known_runtimes

    problems = targets.problems(known_runtimes())
    if problems:
        raise QuantforgeError(problems[0])
    entries = _format_entries(manifest)
    if targets.runtime != "any" and not any(targets.runtime in e["runtimes"] for e in entries):
        served = sorted({r for e in entries for r in e["runtimes"]})
        raise QuantforgeError(
            f"no format of this run runs in {targets.runtime} (its formats run in "
            f"{', '.join(served)}); build one that does or choose another --runtime"
        )
    config = manifest.stage(FETCH)["result"]["config"]
    usable = _add_memory_fit(entries, config, targets)
    candidates = [
        Candidate(
            e["key"],
            e["family"],
            tuple(e["runtimes"]),
            e["bits_per_weight"],
            e["size_bytes"],
            e["metrics"],
            e.get("intervals") or {},
            tuple(e.get("gpu_generations") or ()),
            tuple(e.get("gpu_weight_only") or ()),
        )
        for e in entries
        if e["complete"]
    ]
    failures = manifest.data.get("failures") or {}
    stage_failures = manifest.data.get("stage_failures") or {}
    for entry in entries:
        if entry["key"] in failures:
            entry["failure"] = failures[entry["key"]]
    decision = decide(candidates, targets, usable, {key: f["line"] for key, f in failures.items()}, _gpu(targets))
    plan = manifest.data["plan"]
    reference = manifest.stage(REFERENCE)
    scoring = EvalSettings(**plan["eval_settings"]).scoring  # the settings leave out the default
    return {
        "schema": CARD_SCHEMA,
        "model": manifest.stage(FETCH)["result"] | {"parameters": plan.get("parameters")},
        "evaluation": {
            **plan["eval_settings"],
            "requested_text": plan["eval_settings"]["text"],
            "text": manifest.stage(TOKENS)["result"]["text"],
            "scoring": scoring,
            "convention": convention(scoring, plan["eval_settings"]["context"], plan["eval_settings"]["windows"]),
            "bos_token_id": manifest.stage(TOKENS)["result"].get("bos_token_id"),
            "bos": bos_convention(manifest.stage(TOKENS)["result"].get("bos_token_id")),
        },
        "reference": {
            **reference["result"],
            "tasks": _with_recovery(_task_results(manifest, "reference"), {})[0],
            "speed": (manifest.stage(speed_stage(REFERENCE)) or {}).get("result"),
        },
        "host": (manifest.stage(HOST) or {}).get("result"),
        "calibration": (manifest.stage(CALIBRATION) or {}).get("result"),
        "formats": entries,
        "incomplete": [e["key"] for e in entries if not e["complete"] and e["key"] not in failures],
        # formats that failed, then stages every format shares that failed without stopping the build
        "failed": [failures[key] for key in sorted(failures)] + [stage_failures[key] for key in sorted(stage_failures)],
        "same_format": same_format_comparisons({"formats": entries}),
        "pareto_front": pareto_front(
            [(c.key, c.size_bytes, c.metrics["kld_mean"]) for c in candidates if c.metrics.get("kld_mean") is not None]
        ),
        "targets": targets.to_json(),
        "decision": decision.to_json(),
        "provenance": {
            "quantforge_version": __version__,
            "command": plan.get("command"),
            "run_dir": str(run_dir),
            "stages": {
                key: {
                    "seconds": s.get("seconds"),
                    "input_digest": s.get("input_digest"),
                    "started": s.get("started"),
                    "host": s.get("host"),
                }
                for key, s in manifest.stages.items()
            },
        },
    }


def same_format_comparisons(card: dict) -> list[dict]:
    """Pairs of artifacts of one format made by different backends: which is closer to the reference, by how much."""
    from .uncertainty import kld_ratio_interval

    complete = [e for e in card["formats"] if e.get("complete") and e["metrics"].get("kld_mean") is not None]
    pairs = []
    for index, first in enumerate(complete):
        for second in complete[index + 1 :]:
            if first["format"] != second["format"]:
                continue
            better, worse = sorted((first, second), key=lambda e: e["metrics"]["kld_mean"])
            interval = None
            if better.get("per_window") and worse.get("per_window"):
                interval = kld_ratio_interval(better["per_window"], worse["per_window"])
            pairs.append(
                {
                    "format": first["format"],
                    "better": better["key"],
                    "worse": worse["key"],
                    "size_ratio": better["size_bytes"] / worse["size_bytes"],
                    "kld_ratio": better["metrics"]["kld_mean"] / worse["metrics"]["kld_mean"],
                    # 95%, paired over windows; when it holds 1, which file is closer is within noise
                    "kld_ratio_interval": interval,
                    "ppl_increase_pct": [
                        better["metrics"]["perplexity_increase_pct"],
                        worse["metrics"]["perplexity_increase_pct"],
                    ],
                }
            )
    return pairs


def write_card(run_dir: Path, targets: Targets) -> dict:
    from .html import write_html
    from .modelcard import write_deployment_files

    card = build_card(run_dir, targets)
    atomic_write_text(run_dir / CARD_MARKDOWN, render_markdown(card))
    write_html(run_dir, card)
    write_deployment_files(run_dir, card)
    atomic_write_json(run_dir / CARD_JSON, card)  # last: its presence means the whole card was written
    return card

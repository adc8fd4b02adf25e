"""The comparison card: built from the run manifest alone, so ``quantforge card RUN_DIR`` re-decides in a second.

card.json (schema ``quantforge.card/1``):
    model        source facts (name, origin, Hub id and revision, architecture, parameters)
    evaluation   text (name, source, sha256), context, windows, tokens scored, scoring convention
    reference    the unquantized model's measurements
    formats[]    key, format, scheme, backend, family, runtimes, artifact, size_bytes, bits_per_weight,
                 metrics (perplexity, perplexity_increase_pct, kld_mean, kld_p99, top1_agreement,
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
from .fsutil import atomic_write_json, atomic_write_text
from .manifest import MANIFEST_NAME, Manifest

CARD_SCHEMA = "quantforge.card/1"
CONVENTION = (
    "GPTQ/AutoRound convention: text joined and tokenized once, non-overlapping windows of the context length, "
    "every position after the first of each window scored"
)


def bos_convention(bos_token_id: int | None) -> str:
    if bos_token_id is None:
        return "no BOS token: the model's tokenizer adds none, so windows are text tokens only"
    return (
        f"each window starts with the BOS token (id {bos_token_id}), as the model's tokenizer adds it, followed by "
        "text tokens; the first scored token is the window's first text token (the same ids in every runtime)"
    )


def _task_results(manifest: Manifest, key: str) -> dict:
    names = (manifest.data.get("plan", {}).get("tasks") or {}).get("names") or []
    found = {}
    for name in names:
        stage = manifest.stage(f"tasks/{key}/{name}")
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


def _format_entries(manifest: Manifest) -> list[dict]:
    plan = manifest.data.get("plan", {})
    reference = manifest.stage("reference")["result"]
    reference_tasks = _task_results(manifest, "reference")
    entries = []
    for key, info in plan.get("artifacts", {}).items():
        quantized = manifest.stage(f"quantize/{key}")
        evaluated = manifest.stage(f"evaluate/{key}")
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
        if evaluated:
            result = evaluated["result"]
            metrics = {
                k: result[k]
                for k in (
                    "perplexity",
                    "perplexity_stderr",
                    "kld_mean",
                    "kld_median",
                    "kld_p99",
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
            entry["how"] = {
                k: result.get(k) for k in ("runtime", "threads", "flash_attn", "eval_seconds", "eval_tokens_per_second")
            }
        speed = manifest.stage(f"speed/{key}")
        if speed:
            entry["speed"] = speed["result"]
            if speed["result"].get("measured") and "metrics" in entry:
                entry["metrics"]["decode_tps"] = speed["result"]["decode_tps"]
        entries.append(entry)
    return entries


def _add_memory_fit(entries: list[dict], config: dict, targets: Targets) -> float | None:
    """Each format's fit on the target GPU (or on every GPU of the table); returns the usable GB when --gpu."""
    from .deploy import memory_fit, parse_gpu
    from .probe import GPUS

    gpus = [parse_gpu(targets.gpu)] if targets.gpu else [parse_gpu(name) for name in GPUS]
    usable = None
    for entry in entries:
        if "tensor_bytes" not in (entry.get("quantize") or {}):
            continue
        weight_bytes = entry["quantize"]["tensor_bytes"]
        fits = {gpu.name: memory_fit(weight_bytes, config, gpu, targets.context, targets.concurrency) for gpu in gpus}
        entry["memory_fit"] = fits
        if targets.gpu and "metrics" in entry:
            only = next(iter(fits.values()))
            entry["metrics"]["gpu_needed_gb"] = only["needed_gb"]
            usable = only["usable_gb"]
    return usable


def build_card(run_dir: Path, targets: Targets) -> dict:
    manifest = Manifest.open(run_dir)
    if not manifest.path.exists() or "plan" not in manifest.data:
        raise QuantforgeError(f"{run_dir} holds no quantforge run ({MANIFEST_NAME} is missing); run 'quantforge build'")
    if not manifest.stage("reference"):
        command = manifest.data["plan"].get("command", "quantforge build ...")
        raise QuantforgeError(f"{run_dir} is unfinished: the reference was not evaluated; rerun: {command}")
    problems = targets.problems()
    if problems:
        raise QuantforgeError(problems[0])
    entries = _format_entries(manifest)
    if targets.runtime != "any" and not any(targets.runtime in e["runtimes"] for e in entries):
        served = sorted({r for e in entries for r in e["runtimes"]})
        raise QuantforgeError(
            f"no format of this run runs in {targets.runtime} (its formats run in "
            f"{', '.join(served)}); build one that does or choose another --runtime"
        )
    config = manifest.stage("fetch")["result"]["config"]
    usable = _add_memory_fit(entries, config, targets)
    candidates = [
        Candidate(e["key"], e["family"], tuple(e["runtimes"]), e["bits_per_weight"], e["size_bytes"], e["metrics"])
        for e in entries
        if e["complete"]
    ]
    failures = manifest.data.get("failures") or {}
    for entry in entries:
        if entry["key"] in failures:
            entry["failure"] = failures[entry["key"]]
    decision = decide(candidates, targets, usable, {key: f["line"] for key, f in failures.items()})
    plan = manifest.data["plan"]
    reference = manifest.stage("reference")
    return {
        "schema": CARD_SCHEMA,
        "model": manifest.stage("fetch")["result"] | {"parameters": plan.get("parameters")},
        "evaluation": {
            **plan["eval_settings"],
            "requested_text": plan["eval_settings"]["text"],
            "text": manifest.stage("tokens")["result"]["text"],
            "convention": CONVENTION,
            "bos_token_id": manifest.stage("tokens")["result"].get("bos_token_id"),
            "bos": bos_convention(manifest.stage("tokens")["result"].get("bos_token_id")),
        },
        "reference": {
            **reference["result"],
            "tasks": _with_recovery(_task_results(manifest, "reference"), {})[0],
            "speed": (manifest.stage("speed/reference") or {}).get("result"),
        },
        "host": (manifest.stage("host") or {}).get("result"),
        "calibration": (manifest.stage("calibration") or {}).get("result"),
        "formats": entries,
        "incomplete": [e["key"] for e in entries if not e["complete"] and e["key"] not in failures],
        "failed": [failures[key] for key in sorted(failures)],
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


def _size(size_bytes: int) -> str:
    return f"{size_bytes / 1e6:.1f} MB" if size_bytes < 1e9 else f"{size_bytes / 1e9:.2f} GB"


def _num(value, digits=3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def same_format_comparisons(card: dict) -> list[dict]:
    """Pairs of artifacts of one format made by different backends: which is closer to the reference, by how much."""
    complete = [e for e in card["formats"] if e.get("complete") and e["metrics"].get("kld_mean") is not None]
    pairs = []
    for index, first in enumerate(complete):
        for second in complete[index + 1 :]:
            if first["format"] != second["format"]:
                continue
            better, worse = sorted((first, second), key=lambda e: e["metrics"]["kld_mean"])
            pairs.append(
                {
                    "format": first["format"],
                    "better": better["key"],
                    "worse": worse["key"],
                    "size_ratio": better["size_bytes"] / worse["size_bytes"],
                    "kld_ratio": better["metrics"]["kld_mean"] / worse["metrics"]["kld_mean"],
                    "ppl_increase_pct": [
                        better["metrics"]["perplexity_increase_pct"],
                        worse["metrics"]["perplexity_increase_pct"],
                    ],
                }
            )
    return pairs


def _same_format_comparisons(card: dict) -> list[str]:
    lines = []
    for pair in card.get("same_format", []):
        size = "the same size" if abs(pair["size_ratio"] - 1) < 0.01 else f"{pair['size_ratio']:.3f}x the size"
        lines.append(
            f"Same format, two backends: **{pair['better']}** is closer to the reference than {pair['worse']} at "
            f"{size}: mean KL divergence {pair['kld_ratio']:.2f}x, perplexity change "
            f"{pair['ppl_increase_pct'][0]:+.2f}% against {pair['ppl_increase_pct'][1]:+.2f}%."
        )
    return [""] + lines if lines else []


def _tasks_table(card: dict) -> list[str]:
    reference = card["reference"].get("tasks") or {}
    if not reference:
        return []
    names = list(reference)
    lines = [
        "",
        "## Task accuracy (lm-evaluation-harness)",
        "",
        "| format | " + " | ".join(f"{n} ({reference[n]['metric']})" for n in names) + " | mean recovery |",
        "|---|" + "---|" * (len(names) + 1),
    ]

    def cell(task):
        if not task:
            return "n/a"
        err = f" ± {task['stderr']:.3f}" if task.get("stderr") is not None else ""
        rec = f" ({task['recovery_pct']:.1f}%)" if task.get("recovery_pct") is not None else ""
        return f"{task['value']:.3f}{err}{rec}"

    lines.append("| reference | " + " | ".join(cell(reference[n]) for n in names) + " | 100% |")
    for entry in card["formats"]:
        tasks = entry.get("tasks") or {}
        mean = (entry.get("metrics") or {}).get("task_recovery_pct")
        lines.append(
            f"| {entry['key']} | "
            + " | ".join(cell(tasks.get(n)) for n in names)
            + f" | {'n/a' if mean is None else f'{mean:.1f}%'} |"
        )
    samples = {reference[n]["samples"] for n in names}
    lines.append("")
    lines.append(
        f"Samples per task: {', '.join(str(x) for x in sorted(samples, key=str))}; recovery = format / "
        "reference on the same examples. Every format scored in its own runtime through one lm-eval adapter."
    )
    return lines


def _speed_table(card: dict) -> list[str]:
    rows = [("reference", card["reference"].get("speed"))] + [(e["key"], e.get("speed")) for e in card["formats"]]
    rows = [(key, speed) for key, speed in rows if speed]
    if not rows:
        return []
    first = rows[0][1]
    lines = [
        "",
        "## Decode speed (this host) and the memory-bandwidth roofline",
        "",
        f"Prompt {first['prompt_tokens']} tokens, {first['gen_tokens']} generated greedily, median of "
        f"{first['runs']} runs after a warm-up, {first['threads']} threads; host bandwidth "
        f"{first['host_bandwidth_gbs']:.1f} GB/s (measured). GPU bounds are computed, not measured.",
        "",
        "| format | runtime | prompt tok/s | decode tok/s | TTFT s | TPOT ms | peak MB | host bound tok/s | "
        "of bound | H100 bound tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, speed in rows:
        bound = speed["host_decode_tps_bound"]
        h100 = speed["gpus"]["H100"]["decode_tps_bound"]
        if not speed.get("measured"):
            lines.append(f"| {key} | not measured here (see below) | | | | | | {bound:.0f} | | {h100:.0f} |")
            continue
        lines.append(
            f"| {key} | {speed['runtime']} | {speed['prompt_tps']:.0f} | {speed['decode_tps']:.1f} | "
            f"{speed['ttft_s']:.3f} | {1000 * speed['tpot_s']:.1f} | {speed['peak_rss_mb']:.0f} | {bound:.0f} | "
            f"{100 * speed['fraction_of_roofline']:.0f}% | {h100:.0f} |"
        )
    lines += [""] + [
        f"- {key}: not measured here: {speed['reason']}." for key, speed in rows if not speed.get("measured")
    ]
    return lines


def _fit_table(card: dict) -> list[str]:
    from .deploy import GPU_UTILIZATION, RUNTIME_OVERHEAD_GB

    fitted = [e for e in card["formats"] if e.get("memory_fit")]
    if not fitted:
        return []
    targets = card["targets"]
    gpus = list(fitted[0]["memory_fit"])
    lines = [
        "",
        f"## Memory fit at {targets['context']} tokens x {targets['concurrency']} sequence(s)",
        "",
        f"Weights (artifact tensor bytes) + fp16 KV cache "
        f"({fitted[0]['memory_fit'][gpus[0]]['kv_bytes_per_token']:,} bytes per token) must fit in "
        f"{GPU_UTILIZATION:.0%} of the GPU's memory less {RUNTIME_OVERHEAD_GB:g} GB for activations and the "
        "runtime. Each cell: fits or not, and the largest context that fits.",
        "",
        "| format | " + " | ".join(gpus) + " |",
        "|---|" + "---|" * len(gpus),
    ]
    for entry in fitted:
        cells = []
        for gpu in gpus:
            fit = entry["memory_fit"][gpu]
            cells.append(f"{'yes' if fit['fits'] else 'no'} ({fit['largest_context']:,})")
        lines.append(f"| {entry['key']} | " + " | ".join(cells) + " |")
    return lines


def render_markdown(card: dict) -> str:
    model = card["model"]
    ev = card["evaluation"]
    ref = card["reference"]
    decision = card["decision"]
    lines = [
        f"# quantforge card: {model['name']}",
        "",
        f"Source: {model.get('hub_id') or model['origin']} ({model['config']['architecture']}, "
        f"{card['model'].get('parameters') or 0:,} parameters)",
        "",
        "## Recommendation",
        "",
    ]
    if decision["recommended"]:
        winner = next(v for v in decision["verdicts"] if v["key"] == decision["recommended"])
        lines.append(f"**{decision['recommended']}**: {winner['reason']}.")
    else:
        lines.append(f"**No format meets the targets.** {decision.get('closest') or ''}")
    if decision["best_per_family"]:
        best = ", ".join(f"{family}: {key}" for family, key in sorted(decision["best_per_family"].items()))
        lines.append(f"Best per runtime family: {best}.")
    lines += _same_format_comparisons(card)
    lines += ["", "| format | outcome | why |", "|---|---|---|"]
    lines += [f"| {v['key']} | {v['outcome']} | {v['reason']} |" for v in decision["verdicts"]]
    lines += [
        "",
        "## Measurements",
        "",
        "| format | scheme | size | bits/weight | perplexity | change | KLD mean | KLD p99 | top-1 agree | runtime |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| reference | float | | | {_num(ref['perplexity'])} | | | | | transformers |",
    ]
    for entry in card["formats"]:
        if not entry["complete"]:
            state = "failed" if entry.get("failure") else "incomplete"
            lines.append(f"| {entry['key']} | {entry['scheme']} | {state} | | | | | | | |")
            continue
        m = entry["metrics"]
        lines.append(
            f"| {entry['key']} | {entry['scheme']} | {_size(entry['size_bytes'])} | {entry['bits_per_weight']:.2f} | "
            f"{_num(m.get('perplexity'))} | {m['perplexity_increase_pct']:+.2f}% | {_num(m.get('kld_mean'), 4)} | "
            f"{_num(m.get('kld_p99'), 4)} | {_num(m.get('top1_agreement'), 3)} | {entry['how']['runtime']} |"
        )
    lines += _tasks_table(card)
    lines += _speed_table(card)
    lines += _fit_table(card)
    text = ev.get("text", {})
    targets = {k: v for k, v in card["targets"].items() if v is not None}
    lines += [
        "",
        "## How these figures were made",
        "",
        f"- Text: {text.get('name')} ({text.get('source')}; sha256 {str(text.get('sha256'))[:12]}), "
        f"{ev.get('windows')} windows of {ev.get('context')} tokens, {ref.get('tokens_scored')} tokens scored.",
        *(
            [
                "- The text was asked as 'auto': WikiText-2 was neither cached nor reachable, so the offline fallback "
                "(Python's pydoc topics) was used; perplexities are not comparable with WikiText-2 figures."
            ]
            if ev.get("requested_text") == "auto" and text.get("name") == "pydoc"
            else []
        ),
        f"- {ev['convention']}. llama.cpp's llama-perplexity scores only the second half of each window: its "
        "figures are not comparable with these.",
        f"- BOS: {ev.get('bos') or bos_convention(None)}.",
        "- KL divergence (reference || artifact) per token: exact over the reference's 64 most likely tokens, plus "
        "an unbiased estimate over the rest from 64 tokens drawn from it (fixed seed).",
        "- Every artifact was loaded from disk: GGUF files in llama.cpp (flash attention off, "
        "OMP_WAIT_POLICY=PASSIVE), HF-folder formats (GPTQ, AWQ, INT8) dequantized in torch with their runtime "
        "activation quantization simulated; the reference is the float model in transformers. Torch arithmetic is "
        "float32 throughout, over weights kept as stored (bf16, or packed) and widened one module at a time: the "
        "same logits as a float32 copy, bit for bit.",
        "- Bits per weight: tensor bytes in the artifact x 8 / parameters of the unquantized model.",
        f"- Targets: {', '.join(f'{k}={v}' for k, v in targets.items())}.",
    ]
    calibration = card.get("calibration")
    if calibration:
        text = calibration["text"]
        lines.append(
            f"- Calibration (shared by every calibrating format): {text['name']} ({text['source']}), "
            f"{calibration['samples']} sequences of {calibration['seqlen']} tokens, seed {calibration['seed']}."
        )
    for entry in card["formats"]:
        quantize = entry.get("quantize") or {}
        if quantize.get("group_size_note"):
            lines.append(f"- {entry['key']}: {quantize['group_size_note']} (--group-size auto).")
        if quantize.get("library"):
            lines.append(f"- {entry['key']}: quantized with {quantize['library']}; evaluated dequantized from disk.")
        if quantize.get("fallback_tensors"):
            lines.append(
                f"- {entry['key']}: llama.cpp fell back to another type for {quantize['fallback_tensors']} tensors "
                "(widths not a multiple of the K-quant super-block of 256)."
            )
    for failure in card.get("failed") or []:
        lines.append(f"- Failed: {failure['line']}. Rerunning the same command retries only what failed.")
    if card["incomplete"]:
        lines.append(f"- Incomplete (rerun the build to finish): {', '.join(card['incomplete'])}.")
    if model.get("trust_remote_code"):
        lines.append("- trust_remote_code was ON: the model repository's own Python code ran during this build.")
    if model["config"].get("converted_from_pickle"):
        lines.append("- The source weights were pickle files (allowed with --allow-pickle), converted to safetensors.")
    lines += ["", f"quantforge {card['provenance']['quantforge_version']}: `{card['provenance']['command']}`", ""]
    return "\n".join(lines)


def write_card(run_dir: Path, targets: Targets) -> dict:
    from .deploy import write_deployment_files
    from .html import write_html

    card = build_card(run_dir, targets)
    atomic_write_text(run_dir / "card.md", render_markdown(card))
    write_html(run_dir, card)
    write_deployment_files(run_dir, card)
    atomic_write_json(run_dir / "card.json", card)  # last: its presence means the whole card was written
    return card

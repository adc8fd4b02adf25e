"""The card as Markdown: tables of quality, tasks, speed and memory fit, the verdicts, and how every figure was made.

Reads only the card's JSON (see ``card.py``), so the HTML card renders the same text (``html.py``).
"""

from __future__ import annotations

from .gpus import GENERATION, kernels_run


def bos_convention(bos_token_id: int | None) -> str:
    if bos_token_id is None:
        return "no BOS token: the model's tokenizer adds none, so windows are text tokens only"
    return (
        f"each window starts with the BOS token (id {bos_token_id}), as the model's tokenizer adds it, followed by "
        "text tokens; the first scored token is the window's first text token (the same ids in every runtime)"
    )


def _size(size_bytes: int) -> str:
    return f"{size_bytes / 1e6:.1f} MB" if size_bytes < 1e9 else f"{size_bytes / 1e9:.2f} GB"


def _interval(interval: dict | None, form: str) -> str:
    """ " [low, high]" of a 95% interval, or "" when there is none."""
    if not interval:
        return ""
    return f" [{form.format(interval['low'])}, {form.format(interval['high'])}]"


def _derived(model: dict) -> str:
    """A bundled model's reference is dequantized 4-bit weights: the card says so where it names the source."""
    if not model.get("derived_from"):
        return ""
    from .source import derived_note

    note = derived_note(model["derived_from"])
    return f"; {note}. The reference every figure below compares with is those dequantized weights."


def _default_targets(targets: dict) -> set[str]:
    from .decide import Targets

    known = {k: v for k, v in targets.items() if k in Targets.__dataclass_fields__}
    return Targets(**known).defaults() & {"max_ppl_increase", "max_kld"}  # the quality targets a user may not set


def _num(value, digits=3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _same_format_comparisons(card: dict) -> list[str]:
    lines = []
    for pair in card.get("same_format", []):
        size = "the same size" if abs(pair["size_ratio"] - 1) < 0.01 else f"{pair['size_ratio']:.3f}x the size"
        interval = pair.get("kld_ratio_interval")
        spread = f" [{interval['low']:.2f}, {interval['high']:.2f}]" if interval else ""
        noise = " (within noise: the interval holds 1)" if interval and interval["high"] >= 1 else ""
        lines.append(
            f"Same format, two backends: **{pair['better']}** is closer to the reference than {pair['worse']} at "
            f"{size}: mean KL divergence {pair['kld_ratio']:.2f}x{spread}{noise}, perplexity change "
            f"{pair['ppl_increase_pct'][0]:+.2f}% against {pair['ppl_increase_pct'][1]:+.2f}%."
        )
    return [""] + lines if lines else []


def _search_section(card: dict) -> list[str]:
    """What a gguf-auto search measured and chose, and how to remake its file with llama-quantize alone."""
    lines = []
    for entry in card["formats"]:
        facts = entry.get("quantize") or {}
        search = facts.get("search")
        if not search:
            continue
        target = f"--max-kld {search['target_kld']}" if search.get("target_kld") is not None else "no KL target"
        if search.get("max_size"):
            target += f" within {_size(search['max_size'])}"
        chosen = ", ".join(f"{group} {kind}" for group, kind in sorted(search["chosen"].items())) or "none"
        lines += [
            "",
            f"## {entry['key']}: the searched mix",
            "",
            f"Searched for the smallest mix meeting {target} with the upper end of its 95% interval: every group of "
            f"tensors ({len(search['groups'])}) at {search['base']}, and each group in turn at each other type of "
            f"{', '.join(search['ladder'])}, scored on the first {search['sensitivity_windows']} windows "
            f"({len(search['candidates'])} files in all); the changes were taken as additive to choose, and the "
            f"choice confirmed on all {search['windows']} windows. Changed from {search['base']}: {chosen}.",
            "",
            "| try | file | predicted KLD | measured KLD | upper 95% |",
            "|---|---|---|---|---|",
        ]
        for number, tried in enumerate(search["confirmed"], 1):
            upper = f"{tried['kld_high']:.4f}" if tried.get("kld_high") is not None else "n/a"
            lines.append(
                f"| {number} | {_size(tried['size_bytes'])} | {tried['predicted_kld']:.4f} | "
                f"{tried['kld_mean']:.4f} | {upper} |"
            )
        lines += [
            "",
            f"The folder holds the tensor-type file llama-quantize read ({facts['tensor_type_file']}). Run in the "
            f"run's work/ folder, beside its F16 GGUF and importance matrix, `{facts['reproduce']}` remakes the file "
            "byte for byte.",
        ]
    return lines


def _kv_cache_table(card: dict) -> list[str]:
    """Each file again with a quantized KV cache (--kv-cache), on the same windows."""
    measured = [
        (entry, kv, figures) for entry in card["formats"] for kv, figures in (entry.get("kv_cache") or {}).items()
    ]
    if not measured:
        return []
    lines = [
        "",
        "## KV cache",
        "",
        "Each file again with a quantized KV cache in its runtime, on the same windows, with flash attention on "
        "(llama.cpp quantizes the V cache only with it). KL ratio: the file's mean KL with that cache over its mean "
        "KL with the 16-bit cache, with a 95% interval paired over the windows; above 1 is the cache's own cost.",
        "",
        "| format | KV cache | bytes/value | perplexity change | KLD mean | KL ratio to 16-bit KV | top-1 agree |",
        "|---|---|---|---|---|---|---|",
    ]
    for entry, kv, figures in measured:
        m, spread = figures["metrics"], figures.get("intervals") or {}
        ratio = f"{figures['kld_ratio']:.2f}x" if "kld_ratio" in figures else "n/a"
        lines.append(
            f"| {entry['key']} | {kv} | {figures.get('bytes_per_value') or 0:.4g} | "
            f"{m['perplexity_increase_pct']:+.2f}%{_interval(spread.get('perplexity_increase_pct'), '{:+.2f}')} | "
            f"{_num(m.get('kld_mean'), 4)}{_interval(spread.get('kld_mean'), '{:.4f}')} | "
            f"{ratio}{_interval(figures.get('kld_ratio_interval'), '{:.2f}')} | "
            f"{_num(m.get('top1_agreement'))}{_interval(spread.get('top1_agreement'), '{:.3f}')} |"
        )
    return lines


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
        spread = _interval((entry.get("intervals") or {}).get("task_recovery_pct"), "{:.1f}")
        lines.append(
            f"| {entry['key']} | "
            + " | ".join(cell(tasks.get(n)) for n in names)
            + f" | {'n/a' if mean is None else f'{mean:.1f}%{spread}'} |"
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
    probed = next((speed for _, speed in rows if speed.get("omp_wait_policy")), None)  # cards before it lack one
    policy = f" (OpenMP wait policy: {probed['omp_wait_policy']})" if probed else ""
    lines = [
        "",
        "## Decode speed (this host) and the memory-bandwidth roofline",
        "",
        f"Prompt {first['prompt_tokens']} tokens, {first['gen_tokens']} generated greedily, median of "
        f"{first['runs']} runs after a warm-up, {first['threads']} threads{policy}; host bandwidth "
        f"{first['host_bandwidth_gbs']:.1f} GB/s (measured). GPU bounds are computed, not measured. Each format's "
        "bound is that of the device it ran on.",
        "",
        "| format | runtime | device | prompt tok/s | decode tok/s | TTFT s | TPOT ms | peak MB | bound tok/s | "
        "of bound | H100 bound tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, speed in rows:
        h100 = speed["gpus"]["H100"]["decode_tps_bound"]
        if not speed.get("measured"):
            host = speed["host_decode_tps_bound"]
            lines.append(f"| {key} | not measured here (see below) | | | | | | | {host:.0f} | | {h100:.0f} |")
            continue
        bound = speed.get("decode_tps_bound", speed["host_decode_tps_bound"])  # cards before the device had one
        fraction = speed.get("fraction_of_roofline")
        lines.append(
            f"| {key} | {speed['runtime']} | {_device_cell(speed)} | {speed['prompt_tps']:.0f} | "
            f"{speed['decode_tps']:.1f} | {speed['ttft_s']:.3f} | {1000 * speed['tpot_s']:.1f} | "
            f"{speed['peak_rss_mb']:.0f} | {'' if bound is None else f'{bound:.0f}'} | "
            f"{'' if fraction is None else f'{100 * fraction:.0f}%'} | {h100:.0f} |"
        )
    lines += [""] + [
        f"- {key}: not measured here: {speed['reason']}." for key, speed in rows if not speed.get("measured")
    ]
    lines += [
        f"- {key}: no bound on {speed['device_name']} ({speed['bound_source']})."
        for key, speed in rows
        if speed.get("measured") and speed.get("device_name") and speed.get("decode_tps_bound") is None
    ]
    return lines


def _device_cell(speed: dict) -> str:
    device = speed.get("device", "cpu")
    return f"{device} ({speed['device_name']})" if speed.get("device_name") else device


def _fit_cell(entry: dict, gpu: str) -> str:
    generation = GENERATION.get(gpu)
    how = kernels_run(generation, tuple(entry.get("gpu_generations") or ()), tuple(entry.get("gpu_weight_only") or ()))
    if how == "no":
        return f"does not run ({generation.capitalize()})"
    fit = entry["memory_fit"][gpu]
    cell = f"{'yes' if fit['fits'] else 'no'} ({fit['largest_context']:,})"
    if not fit["fits"] and fit.get("fits_with_quantized_kv"):
        kv = fit["quantized_kv"]
        measured = (entry.get("kv_cache") or {}).get(kv)
        cost = f"KL {measured['kld_ratio']:.2f}x" if measured and "kld_ratio" in measured else "KL cost not measured"
        cell += f"; yes with {kv} KV ({fit['largest_context_quantized_kv']:,}; {cost})"
    if how == "weights alone":
        cell += "; weights alone"
    return cell


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
        "runtime. Each cell: fits or not, and the largest context that fits; where only a quantized KV cache "
        "fits (vLLM's `--kv-cache-dtype fp8`; llama.cpp's `-ctk/-ctv q8_0`, or the type measured with --kv-cache), "
        "the cell says so, with the file's mean KL with that cache as a multiple of its KL with the 16-bit one "
        "where it was measured; where vLLM's kernels for the format do not run on "
        "the GPU's generation, or run its weights alone, the cell says that instead or too.",
        "",
        "| format | " + " | ".join(gpus) + " |",
        "|---|" + "---|" * len(gpus),
    ]
    for entry in fitted:
        cells = [_fit_cell(entry, gpu) for gpu in gpus]
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
        f"Source: {model.get('hub_id') or model['origin'] + ' ' + model['name']} ({model['config']['architecture']}, "
        f"{card['model'].get('parameters') or 0:,} parameters)" + _derived(model),
        "",
        "## Recommendation",
        "",
    ]
    if decision["recommended"]:
        winner = next(v for v in decision["verdicts"] if v["key"] == decision["recommended"])
        lines.append(f"**{decision['recommended']}**: {winner['reason']}.")
    else:
        lines.append(f"**No format meets the targets.** {decision.get('closest') or ''}")
    if decision.get("smallest") and decision["smallest"] != decision["recommended"]:
        entry = next(e for e in card["formats"] if e["key"] == decision["smallest"])
        lines.append(
            f"Smallest file that meets every target: **{entry['key']}** ({_size(entry['size_bytes'])}, "
            f"{entry['bits_per_weight']:.2f} bits/weight)."
        )
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
        "| format | scheme | size | bits/weight | perplexity | change | KLD mean | top-1 agree | runtime |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| reference | float | | | {_num(ref['perplexity'])} | | | | transformers |",
    ]
    for entry in card["formats"]:
        if not entry["complete"]:
            state = "failed" if entry.get("failure") else "incomplete"
            lines.append(f"| {entry['key']} | {entry['scheme']} | {state} | | | | | | |")
            continue
        m = entry["metrics"]
        spread = entry.get("intervals") or {}
        lines.append(
            f"| {entry['key']} | {entry['scheme']} | {_size(entry['size_bytes'])} | {entry['bits_per_weight']:.2f} | "
            f"{_num(m.get('perplexity'))} | {m['perplexity_increase_pct']:+.2f}%"
            f"{_interval(spread.get('perplexity_increase_pct'), '{:+.2f}')} | "
            f"{_num(m.get('kld_mean'), 4)}{_interval(spread.get('kld_mean'), '{:.4f}')} | "
            f"{_num(m.get('top1_agreement'), 3)}"
            f"{_interval(spread.get('top1_agreement'), '{:.3f}')} | {entry['how']['runtime']} |"
        )
    lines += _search_section(card)
    lines += _kv_cache_table(card)
    lines += _tasks_table(card)
    lines += _speed_table(card)
    lines += _fit_table(card)
    text = ev.get("text", {})
    targets = {k: v for k, v in card["targets"].items() if v is not None}
    defaults = _default_targets(card["targets"])
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
        f"- {ev['convention']}. "
        + (
            "llama.cpp's own figures (llama-perplexity, and its --kl-divergence) can be set beside these."
            if ev.get("scoring") == "second-half"
            else "llama.cpp's llama-perplexity scores only the second half of each window: its figures are not "
            "comparable with these (--ppl-scoring second-half scores as it does)."
        ),
        f"- BOS: {ev.get('bos') or bos_convention(None)}.",
        "- KL divergence (reference || artifact) per token: exact over the reference's 64 most likely tokens, plus "
        "an unbiased estimate over the rest from 64 tokens drawn from it (fixed seed).",
        "- Every artifact was loaded from disk: GGUF files in llama.cpp (flash attention off), HF-folder formats "
        "(GPTQ, AWQ, INT8, FP8, FP4) dequantized in torch with their runtime activation quantization simulated, MLX "
        "folders in mlx with float32 activations; the reference "
        "is the float model in transformers. Torch arithmetic is float32 throughout, over weights kept as stored "
        "(bf16, or packed) and widened one module at a time: the same logits as a float32 copy, bit for bit.",
        "- Bits per weight: tensor bytes in the artifact x 8 / parameters of the unquantized model.",
        f"- Intervals in brackets are 95%: perplexity change, KLD and top-1 by Student's t over the "
        f"{ev.get('windows')} windows' paired differences (each window scored by the format and the reference, "
        f"{max((ev.get('windows') or 2) - 1, 1)} degrees of freedom); task recovery by the delta method on lm-eval's "
        "standard errors, treated as independent (wider "
        "than the truth: both are scored on the same examples). A target whose interval holds its limit is "
        "'within noise': the verdict then says so, with about how many more windows or examples would settle it.",
        f"- Targets: {', '.join(f'{k}={v}' + (' (default)' if k in defaults else '') for k, v in targets.items())}.",
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
            how = (entry.get("how") or {}).get("runtime")
            evaluated = f"evaluated from disk in {how}" if how else "not evaluated"
            lines.append(f"- {entry['key']}: quantized with {quantize['library']}; {evaluated}.")
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

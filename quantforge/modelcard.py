"""The files that put each artifact to use: a Hub model card (README.md), an Ollama Modelfile, the source's licence.

The model card carries what a Hub user looks for (licence, pipeline tag, base model with the "quantized" relation,
library, tags), how the artifact was made (method, bits, group size, act-order, calibration set and size), what
quantforge measured on these very files, the run's recommendation, and the commands that serve it. Everything
comes from the run's card and the source's own files; nothing depends on the card's targets except the verdict.
"""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import yaml

from .fsutil import atomic_write_text

# Bundled models are converted from GGUF files of these Hub repos (see source.BUNDLED); their licences are the repos'.
CARD_JSON = "card.json"
LICENSE_FILES = ("LICENSE", "LICENSE.txt", "LICENSE.md", "LICENCE", "NOTICE", "USE_POLICY.md")
HUB_ID_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./")


# ----------------------------------------------------------------------------------------------- the source's facts


def source_front_matter(source_dir: Path) -> dict:
    """The YAML front matter of the source's own model card (README.md), or {} when it has none or is malformed."""
    readme = source_dir / "README.md"
    if not readme.is_file():
        return {}
    text = readme.read_text(errors="replace")
    if not text.startswith("---"):
        return {}
    try:
        front = yaml.safe_load(text.split("---", 2)[1])
    except (yaml.YAMLError, IndexError):
        return {}
    return front if isinstance(front, dict) else {}


def base_model_and_license(model: dict) -> tuple[str | None, dict]:
    """The base model's Hub id (None for a local folder: a folder name is not a Hub id) and its licence fields."""
    source = source_front_matter(Path(model["path"]))
    licence = {key: source[key] for key in ("license", "license_name", "license_link") if source.get(key)}
    if model.get("hub_id"):
        return model["hub_id"], licence
    if model.get("derived_from"):  # dequantized from a 4-bit file: not a quantization of the Hub model's weights
        return None, licence or {"license": model["derived_from"]["license"]}
    base = source.get("base_model")  # a local copy of a Hub model that says where it came from
    if isinstance(base, str) and "/" in base and set(base) <= HUB_ID_CHARS:
        return base, licence
    return None, licence


def chat_template(source_dir: Path) -> tuple[str | None, dict]:
    """The source's chat template and special tokens, read from its files (no tokenizer load)."""
    config_path = source_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    template = config.get("chat_template")
    if template is None and (source_dir / "chat_template.jinja").exists():
        template = (source_dir / "chat_template.jinja").read_text()
    special = {}
    for name in ("bos_token", "eos_token"):
        token = config.get(name)
        special[name] = token.get("content") if isinstance(token, dict) else token
    return (template if isinstance(template, str) else None), special


# ----------------------------------------------------------------------------------------------- the card's parts


def _front_matter(values: dict) -> str:
    return "---\n" + yaml.safe_dump(values, sort_keys=False, allow_unicode=True) + "---\n"


def _quantization_rows(card: dict, entry: dict, quant_config: dict) -> list[str]:
    facts = entry.get("quantize") or {}
    rows = [
        "| setting | value |",
        "|---|---|",
        f"| method | {entry['scheme']} ({entry['format']}) |",
        f"| made by | {facts.get('library') or facts.get('quantizer') or entry['backend']} "
        f"({entry['backend']} backend of quantforge) |",
        f"| bits per weight | {entry['bits_per_weight']:.2f} over all tensors |",
    ]
    bits = facts.get("bits", quant_config.get("bits"))
    if bits:
        rows.append(f"| weight bits | {bits} |")
    group_size = facts.get("group_size", quant_config.get("group_size"))
    if group_size:
        rows.append(f"| group size | {group_size} |")
    act_order = facts.get("act_order", quant_config.get("desc_act"))
    if act_order is not None:
        rows.append(f"| act-order (desc_act) | {'yes' if act_order else 'no'} |")
    if facts.get("tensor_types"):
        types = ", ".join(f"{name} x{count}" for name, count in sorted(facts["tensor_types"].items()))
        rows.append(f"| tensor types | {types} |")
    if facts.get("fallback_tensors"):
        rows.append(f"| fallback tensors | {facts['fallback_tensors']} (width not a multiple of the block size) |")
    if facts.get("calibration_samples"):
        calibration = card.get("calibration") or {}
        text = calibration.get("text") or {}
        rows.append(
            f"| calibration | {text.get('name', 'unknown')} ({text.get('source', 'unknown source')}): "
            f"{facts['calibration_samples']} sequences x {facts.get('calibration_seqlen', '?')} tokens, "
            f"seed {calibration.get('seed', 0)} |"
        )
        if facts.get("calibration_dtype"):
            rows.append(f"| calibration arithmetic | {facts['calibration_dtype']} |")
    else:
        rows.append("| calibration | none (round-to-nearest from the weights alone) |")
    return rows


def _evaluation_rows(card: dict, entry: dict) -> list[str]:
    reference = card["reference"]
    metrics = entry["metrics"]
    rows = [
        "| metric | reference | this model |",
        "|---|---|---|",
        f"| perplexity ({card['evaluation']['text']['name']}, {card['evaluation']['context']} tokens) | "
        f"{reference['perplexity']:.3f} | {metrics['perplexity']:.3f} ({metrics['perplexity_increase_pct']:+.2f}%) |",
        f"| mean KL divergence | 0 | {metrics['kld_mean']:.4f} |",
        f"| top-1 agreement | 1 | {metrics['top1_agreement']:.3f} |",
    ]
    return rows


def _recovery_rows(card: dict, entry: dict) -> list[str]:
    """Task accuracy beside the reference's and the share of it kept, as quantized model cards show it (recovery:
    this file's accuracy over the reference's, same task, same examples)."""
    tasks = entry.get("tasks") or {}
    if not tasks:
        return []
    rows = ["| task | metric | examples | reference | this model | recovery |", "|---|---|---|---|---|---|"]
    for name, task in tasks.items():
        base = card["reference"]["tasks"][name]["value"]
        recovery = task.get("recovery_pct")
        kept = f"{recovery:.1f}%" if recovery is not None else "n/a"
        rows.append(f"| {name} | {task['metric']} | {task['samples']} | {base:.3f} | {task['value']:.3f} | {kept} |")
    mean = entry["metrics"].get("task_recovery_pct")
    if mean is not None and len(tasks) > 1:
        rows.append(f"| mean | | | | | {mean:.1f}% |")
    return ["", *rows]


def _made_by(card: dict) -> list[str]:
    """The quantforge version and the command that made the run (its --out left out: where the run was written is
    not part of how the files were made)."""
    provenance = card.get("provenance") or {}
    command = provenance.get("command")
    if not command:
        return []
    words = shlex.split(command)
    kept = [w for i, w in enumerate(words) if w != "--out" and (i == 0 or words[i - 1] != "--out")]
    return [
        "",
        f"Made by quantforge {provenance.get('quantforge_version', '?')} with:",
        "",
        "```bash",
        shlex.join(kept),
        "```",
    ]


def _recommendation(card: dict, entry: dict) -> str:
    decision = card["decision"]
    verdict = next((v for v in decision["verdicts"] if v["key"] == entry["key"]), None)
    if decision.get("recommended") == entry["key"]:
        return f"quantforge recommends this format for the run's targets: {verdict['reason']}."
    chosen = decision.get("recommended") or "none of the formats"
    why = f" ({verdict['outcome']}: {verdict['reason']})" if verdict else ""
    return f"For the run's targets quantforge recommended {chosen}, not this format{why}."


def model_card(card: dict, entry: dict, deployment) -> str:
    """The README.md of one artifact; ``deployment`` (a ``backends.Deployment``) is its backend's part."""
    model = card["model"]
    calibrated = bool((entry.get("quantize") or {}).get("calibration_samples"))
    front, base, licence = _front(card, deployment.library, [*deployment.tags, entry["format"]], calibrated)
    base_text = _model_text(model, base)
    licence_line = (
        f"Licence: {licence['license']}, as the base model's."
        if licence
        else "Licence: the base model's; its model card names none, so check its terms before publishing."
    )
    lines = [
        _front_matter(front),
        f"# {model['name']} {entry['scheme']}",
        "",
        f"{entry['scheme']} quantization of {base_text}, made with quantforge: "
        f"{entry['bits_per_weight']:.2f} bits per weight over all tensors, {entry['size_bytes'] / 1e6:.1f} MB. "
        + licence_line,
        "",
        "## Quantization",
        "",
        *_quantization_rows(card, entry, deployment.quant_config),
        "",
        "## Evaluation",
        "",
        *_evaluation_rows(card, entry),
        "",
        *_recovery_rows(card, entry),
        "",
        "Measured by quantforge on these files, on the same tokens as the unquantized reference. How each figure "
        f"was made is in {CARD_JSON}, the run's card, which `quantforge push` uploads beside them.",
        *_made_by(card),
        "",
        "## Recommendation",
        "",
        _recommendation(card, entry),
        "",
        "## Usage",
        "",
        *deployment.usage,
        "",
    ]
    return "\n".join(lines)


def _model_text(model: dict, base: str | None) -> str:
    """How a model card names what was quantized: the Hub link, or what a bundled or local model really is."""
    if model.get("derived_from"):
        from .source import derived_note

        return f"{model['name']} ({derived_note(model['derived_from'])}; the figures compare with those weights)"
    return f"[{base}](https://huggingface.co/{base})" if base else f"{model['name']} (a local model)"


def calibration_dataset(card: dict) -> str | None:
    """The Hub id of the run's calibration set, when it came from the Hub through datasets (not a local file)."""
    source = ((card.get("calibration") or {}).get("text") or {}).get("source") or ""
    if not source.startswith("datasets "):  # "datasets allenai/c4" (", as its file" when read from its cached file)
        return None
    dataset = source.split()[1].rstrip(",")
    return dataset if "/" in dataset and set(dataset) <= HUB_ID_CHARS else None


def _front(card: dict, library: str, tags: list[str], calibrated: bool = False) -> tuple[dict, str | None, dict]:
    base, licence = base_model_and_license(card["model"])
    front: dict = {}
    if base:
        front["base_model"] = base
        front["base_model_relation"] = "quantized"
    front.update(licence)
    dataset = calibration_dataset(card) if calibrated else None
    if dataset:  # the Hub links the data set a file was calibrated (or its importance matrix collected) on
        front["datasets"] = [dataset]
    front["pipeline_tag"] = "text-generation"
    front["library_name"] = library
    front["tags"] = ["quantforge", "quantized", *tags]
    front["quantized_by"] = "quantforge"
    return front, base, licence


def _which_file_rows(card: dict, entries: list[dict], labels: dict[str, str]) -> list[str]:
    """ "Which file should I download?", answered from this run's measurements of these files."""
    closest = min(entries, key=lambda e: e["metrics"]["kld_mean"])
    smallest = min(entries, key=lambda e: e["size_bytes"])
    front = [e for e in entries if e["key"] in set(card.get("pareto_front") or [])]
    recommended = next((e for e in entries if e["key"] == card["decision"].get("recommended")), None)
    rows = ["| if you want | take | because |", "|---|---|---|"]
    if recommended:
        verdict = next(v for v in card["decision"]["verdicts"] if v["key"] == recommended["key"])
        rows.append(f"| the run's targets met | {labels[recommended['key']]} | {verdict['reason']} |")
    rows.append(
        f"| the closest to the unquantized model | {labels[closest['key']]} | the lowest mean KLD, "
        f"{closest['metrics']['kld_mean']:.4f} |"
    )
    rows.append(
        f"| the smallest file | {labels[smallest['key']]} | {smallest['size_bytes'] / 1e6:.1f} MB at mean KLD "
        f"{smallest['metrics']['kld_mean']:.4f} |"
    )
    if len(front) > 1:
        listed = ", ".join(labels[e["key"]] for e in sorted(front, key=lambda e: e["size_bytes"]))
        rows.append(
            f"| the most quality for the size | one of {listed} | no other file here is both smaller and closer "
            "to the reference |"
        )
    return rows


def write_gguf_repo_card(
    card: dict,
    entries: list[dict],
    repo_id: str,
    names: dict[str, list[str]],
    labels: dict[str, str] | None = None,
    plot: str | None = None,
) -> str:
    """The model card of a repo of GGUF files: one row per file, which file to take, the run's recommendation, usage
    with the repo's id (``labels``: each file's quant tag as llama.cpp's ``-hf REPO:TAG`` matches it; ``plot``: a
    picture uploaded beside it)."""
    calibrated = any((e.get("quantize") or {}).get("calibration_samples") for e in entries)
    front, base, licence = _front(card, "gguf", ["gguf", *(e["format"] for e in entries)], calibrated)
    model = card["model"]
    reference = card["reference"]
    context = card["targets"]["context"]
    labels = labels or {e["key"]: e["scheme"] for e in entries}
    with_tasks = any(e.get("tasks") for e in entries)
    rows = [
        "| file | quant | bits/weight | size | perplexity change | mean KLD | top-1 agreement |"
        + (" task recovery |" if with_tasks else ""),
        "|---|---|---|---|---|---|---|" + ("---|" if with_tasks else ""),
    ]
    for entry in entries:
        metrics = entry["metrics"]
        recovery = metrics.get("task_recovery_pct")
        rows.append(
            f"| {' + '.join(names[entry['key']])} | {entry['scheme']} | {entry['bits_per_weight']:.2f} | "
            f"{entry['size_bytes'] / 1e6:.1f} MB | {metrics['perplexity_increase_pct']:+.2f}% | "
            f"{metrics['kld_mean']:.4f} | {metrics['top1_agreement']:.3f} |"
            + ((f" {recovery:.1f}% |" if recovery is not None else " n/a |") if with_tasks else "")
        )
    recommended = card["decision"].get("recommended")
    tag = next((labels[e["key"]] for e in entries if e["key"] == recommended), labels[entries[0]["key"]])
    split = any(len(files) > 1 for files in names.values())
    lines = [
        _front_matter(front),
        f"# {model['name']} GGUF",
        "",
        f"GGUF quantizations of {_model_text(model, base)}, made with "
        f"quantforge and measured on these files against the unquantized reference (perplexity "
        f"{reference['perplexity']:.3f} on {card['evaluation']['text']['name']}, {card['evaluation']['context']}-token "
        f"windows). " + (f"Licence: {licence['license']}, as the base model's." if licence else ""),
        "",
        "## Files",
        "",
        *rows,
        "",
        *([f"![mean KL divergence against file size, every format of the run]({plot})", ""] if plot else []),
        f"How each figure was made is in {CARD_JSON}, the run's card, uploaded beside the files.",
        *_made_by(card),
        "",
        "## Which file",
        "",
        *_which_file_rows(card, entries, labels),
        "",
        "## Recommendation",
        "",
        f"For the run's targets quantforge recommended {recommended or 'none of these files'}.",
        "",
        "## Usage",
        "",
        "```bash",
        f"llama-server -hf {repo_id}:{tag} -c {context} --jinja",
        f"ollama run hf.co/{repo_id}:{tag}",
        f'hf download {repo_id} --include "*{tag}*" --local-dir .',
        "```",
        "",
        "Each file has a Modelfile beside it (`Modelfile.<quant>`) for `ollama create NAME -f Modelfile.<quant>`.",
    ]
    if split:
        lines += [
            "",
            "Files split as `NAME-0000k-of-0000n.gguf` are in llama.cpp's split format: llama.cpp loads them from "
            "the first shard; merge them with `llama-gguf-split --merge` for runtimes that need one file.",
        ]
    return "\n".join(lines + [""])


def for_repo(readme: str, folder_name: str, repo_id: str, plot: str | None = None) -> str:
    """An artifact's model card as its own Hub repo shows it: the usage names the repo, not the local folder
    (``./awq`` becomes ``ORG/NAME-AWQ``), and the run's plot, uploaded beside it, is shown."""
    text = readme.replace(f"./{folder_name}", repo_id)
    if plot:
        picture = f"![mean KL divergence against file size, every format of the run]({plot})"
        text = text.replace("\n## Recommendation\n", f"\n{picture}\n\n## Recommendation\n", 1)
    return text


def _copy_licence_files(source_dir: Path, folder: Path) -> None:
    """The source's licence files travel with every artifact (many licences require it of a redistribution)."""
    for name in LICENSE_FILES:
        if (source_dir / name).is_file() and not (folder / name).exists():
            shutil.copyfile(source_dir / name, folder / name)


def write_deployment_files(run_dir: Path, card: dict) -> None:
    """README.md (model card) and the source's licence files in every artifact folder, with what its backend says
    about serving it (``Backend.deployment``: for GGUF also an Ollama Modelfile). The files depend on measurements,
    not on the card's targets (apart from the recommendation)."""
    from .backends import load_backends

    backends = load_backends()
    source_dir = Path(card["model"]["path"])
    chat = chat_template(source_dir)
    for entry in card["formats"]:
        if not entry.get("complete"):
            continue
        folder = run_dir / entry["artifact"]
        _copy_licence_files(source_dir, folder)
        atomic_write_text(
            folder / "README.md", model_card(card, entry, _deployment(folder, card, entry, chat, backends))
        )


def _deployment(folder: Path, card: dict, entry: dict, chat: tuple, backends: dict):
    """What the backend that made ``entry`` says; when it is no longer installed (a card re-written elsewhere), what
    the first backend writing the same family says, else only the runtimes."""
    from .backends import plain_deployment
    from .errors import QuantforgeError, one_line

    same_family = [b for b in backends.values() if any(f.family == entry["family"] for f in b.formats.values())]
    backend = backends.get(entry["backend"]) or next(iter(same_family), None)
    if backend is None:
        return plain_deployment(folder, entry)
    try:
        return backend.deployment(folder, card, entry, chat)
    except QuantforgeError:
        raise
    except Exception as exc:  # a plugin's hook: one line naming the format and backend, not a traceback
        raise QuantforgeError(
            f"{entry['key']}: backend {backend.name} failed to write its model card's usage ({one_line(exc)})"
        ) from exc

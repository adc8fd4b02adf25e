"""The files that put each artifact to use: a Hub model card (README.md), an Ollama Modelfile, the source's licence.

The model card carries what a Hub user looks for (licence, pipeline tag, base model with the "quantized" relation,
library, tags), how the artifact was made (method, bits, group size, act-order, calibration set and size), what
quantforge measured on these very files, the run's recommendation, and the commands that serve it. Everything
comes from the run's card and the source's own files; nothing depends on the card's targets except the verdict.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from .fsutil import atomic_write_text

# Bundled models are converted from GGUF files of these Hub repos (see source.BUNDLED); their licences are the repos'.
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
    for name, task in (entry.get("tasks") or {}).items():
        base = reference["tasks"][name]["value"]
        rows.append(f"| {name} ({task['metric']}, {task['samples']} examples) | {base:.3f} | {task['value']:.3f} |")
    return rows


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
    front, base, licence = _front(card, deployment.library, [*deployment.tags, entry["format"]])
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
        "Measured by quantforge on the files in this folder, on the same tokens as the unquantized reference "
        "(see card.json of the run for how each figure was made).",
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


def _front(card: dict, library: str, tags: list[str]) -> tuple[dict, str | None, dict]:
    base, licence = base_model_and_license(card["model"])
    front: dict = {}
    if base:
        front["base_model"] = base
        front["base_model_relation"] = "quantized"
    front.update(licence)
    front["pipeline_tag"] = "text-generation"
    front["library_name"] = library
    front["tags"] = ["quantforge", "quantized", *tags]
    front["quantized_by"] = "quantforge"
    return front, base, licence


def write_gguf_repo_card(card: dict, entries: list[dict], repo_id: str, names: dict[str, list[str]]) -> str:
    """The model card of a repo holding several GGUF files: one row per file, the run's recommendation, usage."""
    front, base, licence = _front(card, "gguf", ["gguf", *(e["format"] for e in entries)])
    model = card["model"]
    reference = card["reference"]
    context = card["targets"]["context"]
    rows = [
        "| file | quant | bits/weight | size | perplexity change | mean KLD | top-1 agreement |",
        "|---|---|---|---|---|---|---|",
    ]
    for entry in entries:
        metrics = entry["metrics"]
        rows.append(
            f"| {' + '.join(names[entry['key']])} | {entry['scheme']} | {entry['bits_per_weight']:.2f} | "
            f"{entry['size_bytes'] / 1e6:.1f} MB | {metrics['perplexity_increase_pct']:+.2f}% | "
            f"{metrics['kld_mean']:.4f} | {metrics['top1_agreement']:.3f} |"
        )
    recommended = card["decision"].get("recommended")
    scheme = next((e["scheme"] for e in entries if e["key"] == recommended), entries[0]["scheme"])
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
        "## Recommendation",
        "",
        f"For the run's targets quantforge recommended {recommended or 'none of these files'}.",
        "",
        "## Usage",
        "",
        "```bash",
        f"llama-server -hf {repo_id}:{scheme} -c {context} --jinja",
        f"ollama run hf.co/{repo_id}:{scheme}",
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

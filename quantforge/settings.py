"""Build settings: one table, from which the command line's options, ``BuildRequest``, the recipe schema and the
release schema are all read. Adding a setting is one row here; the stage that uses it reads the resolved value
from ``Plan.settings`` (or the request).

A value comes from, in order: the command line (or a release file's model entry), the recipe, the row's default.
``key`` is where recipes and release files hold it ("eval.context" is ``eval: {context: ...}``); a row without a
key is for the command line only (``--allow-pickle`` must be asked for where the build is run, never by a file).
Targets have their own table (``decide.Targets`` and the CLI's target options): they are re-read by ``quantforge
card`` as well as ``build``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_FORMATS = ["gguf-q8_0", "gguf-q5km", "gguf-q4km"]


@dataclass(frozen=True)
class Setting:
    name: str  # the BuildRequest field and the click parameter
    kind: str  # int, str, bool, list (comma-separated on the command line), path, int_or_auto
    default: Any  # when neither the command line nor the recipe gives one (None: decided where it is used)
    flag: str | None  # the click option ("--speed/--no-speed" for a two-way switch); None: files only
    help: str
    key: str | None  # where recipes and release files hold it; None: the command line only
    choices: tuple[str, ...] | None = None  # the only values allowed (click.Choice on the command line)
    minimum: int | None = None  # the smallest value allowed (an int setting)
    aliases: tuple[str, ...] = ()  # other flags for it on the command line


PPL_SCORINGS = ("all", "second-half")  # every position of a window after its first; llama-perplexity's second half
QUANTIZE_DTYPES = ("auto", "bfloat16", "float32")


SETTINGS: tuple[Setting, ...] = (
    Setting("revision", "str", None, "--revision",
            "Hub branch, tag or commit of the model (default: the recipe's, or main).", "revision"),
    Setting("formats", "list", DEFAULT_FORMATS, "--formats",
            "Comma-separated formats (see 'quantforge formats'). Default: the recipe's, or "
            "gguf-q8_0,gguf-q5km,gguf-q4km.", "formats"),
    Setting("backends", "list", None, "--backend",
            "Comma-separated backends, where more than one can make a format.", "backends", aliases=("--backends",)),
    Setting("eval_text", "str", "auto", "--eval-text",
            "Perplexity text: a name (wikitext2, pydoc; 'auto' = wikitext2 if it can be had, else pydoc) or a local "
            ".txt/.jsonl file.", "eval.text"),
    Setting("ppl_context", "int", 512, "--ppl-context", "Tokens per perplexity window (default 512).", "eval.context",
            minimum=16),
    Setting("ppl_windows", "int", 16, "--ppl-windows", "Number of perplexity windows (default 16).", "eval.windows",
            minimum=1),
    Setting("ppl_scoring", "str", "all", "--ppl-scoring",
            "Positions scored in each window: 'all' (every one after the first; default) or 'second-half' "
            "(llama-perplexity's convention, figures comparable with llama.cpp's).", "eval.scoring",
            choices=PPL_SCORINGS),
    Setting("threads", "int", None, "--threads",
            "CPU threads for quantization and evaluation (default: all cores).", "eval.threads", minimum=1),
    Setting("tasks", "list", None, "--tasks",
            "Comma-separated lm-eval tasks (arc_easy, hellaswag, piqa, winogrande, lambada; all five when only "
            "--tasks-data is given; gsm8k: greedy generation, exact match).", "eval.tasks"),
    Setting("tasks_data", "path", None, "--tasks-data", "Folder holding the tasks' data files.", "eval.tasks_data"),
    Setting("limit", "int", None, "--limit", "Examples per task (default: all).", "eval.limit", minimum=1),
    Setting("kv_cache", "list", None, "--kv-cache",
            "Quantized KV-cache types to measure each GGUF with (llama.cpp's q8_0, q4_0): the KL each costs on the "
            "same windows goes on the card, and the memory fit and llama-server commands may use the measured one "
            "(default: none).", "eval.kv_cache"),
    Setting("speed", "bool", True, "--speed/--no-speed", "Run the decode-speed probe (default on).", "speed"),
    Setting("prompt_tokens", "int", 128, "--prompt-tokens", "Speed probe prompt length (default 128).",
            "eval.prompt_tokens", minimum=1),
    Setting("gen_tokens", "int", 64, "--gen-tokens", "Speed probe generated tokens (default 64).", "eval.gen_tokens",
            minimum=1),
    Setting("calibration", "str", "auto", "--calibration",
            "Calibration set: a name (c4, wikitext2-train, pile-val, stdlib-docstrings; 'auto' = c4 if it can be "
            "had, else stdlib-docstrings) or a local .txt/.jsonl file.", "calibration.dataset"),
    Setting("calib_samples", "int", 128, "--calib-samples", "Calibration sequences (default 128).",
            "calibration.samples", minimum=1),
    Setting("calib_seqlen", "int", 512, "--calib-seqlen", "Tokens per calibration sequence (default 512).",
            "calibration.seqlen", minimum=8),
    Setting("calib_seed", "int", 0, "--calib-seed", "Seed that picks the calibration sequences (default 0).",
            "calibration.seed"),
    Setting("group_size", "int_or_auto", 128, "--group-size",
            "Quantization group size for GPTQ/AWQ (default 128), or 'auto': the largest of 128/64/32/16 that "
            "divides every layer width.", "quantize.group_size"),
    Setting("act_order", "bool", False, "--act-order/--no-act-order",
            "GPTQ activation order (desc_act); default off.", "quantize.act_order"),
    Setting("layer_resume", "flag", False, "--layer-resume",
            "Let GPTQModel resume a killed quantization at the layer where it stopped (llama models); faster, but "
            "the bytes then differ from an uninterrupted run.", "quantize.layer_resume"),
    Setting("quantize_dtype", "str", "auto", "--quantize-dtype",
            "Arithmetic of GPTQModel's GPTQ: bfloat16, float32, or 'auto' (default): float32 on a CPU without bf16 "
            "instructions when it fits in memory, else bfloat16. Unquantized tensors are saved in bf16 either way.",
            "quantize.dtype", choices=QUANTIZE_DTYPES),
    Setting("allow_pickle", "flag", False, "--allow-pickle",
            "Allow pickle (.bin) weights, which can run code when loaded.", None),
    Setting("trust_remote_code", "flag", False, "--trust-remote-code",
            "Allow the model repo's own Python code to run.", "trust_remote_code"),
    Setting("device", "str", "auto", "--device",
            "Where torch work runs (reference, dequantized evaluation, torch quantizers): auto, cpu, cuda, cuda:N "
            "(default auto).", "device"),
)  # fmt: skip
BY_NAME = {setting.name: setting for setting in SETTINGS}

# What a value must be in a recipe or release file, per kind (checked by recipes._check, with file and line).
FILE_TYPES = {"int": int, "str": str, "bool": bool, "flag": bool, "list": list, "path": str, "int_or_auto": (int, str)}


def file_schema() -> dict:
    """The settings' part of the recipe and release schemas: nested mappings of key -> type."""
    schema: dict = {}
    for setting in SETTINGS:
        if setting.key is None:
            continue
        *sections, leaf = setting.key.split(".")
        node = schema
        for section in sections:
            node = node.setdefault(section, {})
        node[leaf] = FILE_TYPES[setting.kind]
    return schema


def from_file(mapping: dict, base: Path | None = None) -> dict:
    """name -> value for every setting a recipe or release mapping gives (paths relative to ``base``)."""
    values = {}
    for setting in SETTINGS:
        if setting.key is None:
            continue
        node: Any = mapping
        for part in setting.key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            continue
        if setting.kind == "path":
            node = Path(node) if base is None or Path(node).is_absolute() else base / node
        values[setting.name] = node
    return values


def resolve(given: dict, recipe_values: dict) -> dict:
    """name -> value for every setting: the command line's (None: not given), else the recipe's, else the default."""
    resolved = {}
    for setting in SETTINGS:
        value = given.get(setting.name)
        if value is None or (setting.kind == "list" and not value):
            value = recipe_values.get(setting.name)
        if value is None or (setting.kind == "list" and not value):
            value = setting.default
        resolved[setting.name] = list(value) if isinstance(value, list) else value
    return resolved


def split_list(value: str | None) -> list[str] | None:
    if not value:
        return None
    return [item.strip() for item in value.split(",") if item.strip()]


def click_options(function):
    """Every setting with a flag as a click option whose parameter is the setting's name (default None: unset)."""
    import click

    kinds = {"int": int, "str": str, "list": str, "path": click.Path(path_type=Path), "int_or_auto": str}
    for setting in reversed(SETTINGS):
        if setting.flag is None:
            continue
        if setting.kind == "bool":
            option = click.option(setting.flag, setting.name, default=None, help=setting.help)
        elif setting.kind == "flag":
            option = click.option(setting.flag, setting.name, is_flag=True, default=None, help=setting.help)
        elif setting.choices:
            option = click.option(setting.flag, setting.name, type=click.Choice(setting.choices), help=setting.help)
        else:
            kind = kinds[setting.kind]
            option = click.option(setting.flag, *setting.aliases, setting.name, type=kind, help=setting.help)
        function = option(function)
    return function


def from_command_line(values: dict) -> dict:
    """The click parameters of the settings, as request values (lists split at commas)."""
    return {
        setting.name: split_list(values.get(setting.name)) if setting.kind == "list" else values.get(setting.name)
        for setting in SETTINGS
        if setting.flag is not None
    }


def check(values: dict) -> None:
    """One line for the first resolved value outside its row's choices or below its minimum: values from a recipe or
    release file meet the same checks as the command line's."""
    from .errors import QuantforgeError

    for setting in SETTINGS:
        value = values.get(setting.name)
        if value is None:
            continue
        name = (setting.flag or setting.name).split("/")[0]
        if setting.key:
            name += f" ({setting.key} in a recipe or release file)"
        if setting.choices and value not in setting.choices:
            raise QuantforgeError(f"{name} must be one of {', '.join(setting.choices)}, not {value!r}")
        if setting.minimum is not None and isinstance(value, int) and value < setting.minimum:
            raise QuantforgeError(f"{name} must be at least {setting.minimum}, not {value}")

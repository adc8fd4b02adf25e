"""Recipes: per-model YAML files that name the model and its defaults (formats, evaluation, targets, settings).

Errors name the file, the line and the key, because recipes are written by hand and fed in by release pipelines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .errors import QuantforgeError
from .paths import find_definitions

# key -> expected type, or a nested schema for a mapping. Types are checked; unknown keys are errors.
SCHEMA: dict = {
    "name": str,
    "description": str,
    "model": str,
    "revision": str,
    "formats": list,
    "backends": list,
    "eval": {
        "text": str,
        "context": int,
        "windows": int,
        "threads": int,
        "tasks": list,
        "tasks_data": str,
        "limit": int,
    },
    "targets": {
        "max_ppl_increase": (int, float),
        "max_kld": (int, float),
        "min_top1_agreement": (int, float),
        "min_recovery": (int, float),
        "max_size_gb": (int, float),
        "min_decode_tps": (int, float),
        "gpu": str,
        "context": int,
        "concurrency": int,
        "runtime": str,
    },
    "quantize": {"group_size": (int, str), "act_order": bool, "layer_resume": bool},
    "calibration": {"dataset": str, "samples": int, "seqlen": int, "seed": int},
    # The model's size, from its config.json, so `build --plan-only` can plan it before anything is downloaded.
    "size": {
        "parameters": int,
        "hidden_size": int,
        "intermediate_size": int,
        "num_layers": int,
        "vocab_size": int,
        "tie_word_embeddings": bool,
        "dtype": str,
    },
}


@dataclass
class Recipe:
    name: str
    model: str
    path: Path | None = None
    revision: str | None = None
    description: str = ""
    formats: list[str] = field(default_factory=list)
    backends: list[str] = field(default_factory=list)
    eval: dict = field(default_factory=dict)
    targets: dict = field(default_factory=dict)
    quantize: dict = field(default_factory=dict)
    calibration: dict = field(default_factory=dict)
    size: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "model": self.model,
            "revision": self.revision,
            "path": str(self.path) if self.path else None,
            "formats": self.formats,
            "backends": self.backends,
            "eval": self.eval,
            "targets": self.targets,
            "quantize": self.quantize,
            "calibration": self.calibration,
            "size": self.size,
        }


def known_recipes() -> dict[str, Path]:
    return find_definitions("recipes")


def _type_name(expected) -> str:
    types = expected if isinstance(expected, tuple) else (expected,)
    return " or ".join(
        {str: "text", int: "an integer", float: "a number", list: "a list", dict: "a mapping", bool: "true or false"}[t]
        for t in types
    )


def _check(node: yaml.Node, schema: dict, path: Path, where: str) -> dict:
    """Validate a mapping node against ``schema`` and return it as plain Python data."""
    if not isinstance(node, yaml.MappingNode):
        raise QuantforgeError(f"{path}:{node.start_mark.line + 1}: {where or 'the recipe'} must be a mapping of keys")
    result = {}
    for key_node, value_node in node.value:
        line = key_node.start_mark.line + 1
        if not isinstance(key_node, yaml.ScalarNode):
            raise QuantforgeError(f"{path}:{line}: a key must be a plain name, not a list or mapping")
        key = key_node.value
        label = f"{where}.{key}" if where else key
        if key not in schema:
            raise QuantforgeError(f"{path}:{line}: unknown key '{label}' (allowed here: {', '.join(sorted(schema))})")
        expected = schema[key]
        if isinstance(expected, dict):
            result[key] = _check(value_node, expected, path, label)
            continue
        value = yaml.safe_load(yaml.serialize(value_node))
        types = expected if isinstance(expected, tuple) else (expected,)
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            raise QuantforgeError(f"{path}:{line}: key '{label}' must be {_type_name(expected)}, not {value!r}")
        if expected is list and not all(isinstance(item, str) for item in value):
            raise QuantforgeError(f"{path}:{line}: key '{label}' must be a list of names")
        result[key] = value
    return result


def read_yaml_text(path: Path, what: str) -> str:
    """The text of a recipe or release file, or a one-line error (unreadable, or not UTF-8 as YAML requires)."""
    try:
        return path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise QuantforgeError(f"cannot read {what} {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise QuantforgeError(f"{path}: not UTF-8 text (byte {exc.start}); save the {what} as UTF-8") from None


def load_recipe(path: Path) -> Recipe:
    text = read_yaml_text(path, "recipe")
    try:
        node = yaml.compose(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise QuantforgeError(f"{path}{line}: malformed YAML ({getattr(exc, 'problem', None) or exc})") from None
    if node is None:
        raise QuantforgeError(f"{path}: the recipe is empty; it needs at least 'model'")
    data = _check(node, SCHEMA, path, "")
    if "model" not in data:
        raise QuantforgeError(f"{path}: the recipe has no 'model' key (a Hub id, a folder or bundled:NAME)")
    return Recipe(path=path, name=data.get("name", path.stem), **{k: v for k, v in data.items() if k != "name"})


def find_recipe(name: str) -> Recipe | None:
    path = known_recipes().get(name)
    return load_recipe(path) if path else None

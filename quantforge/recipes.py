"""Recipes: per-model YAML files that name the model and its defaults (formats, evaluation, targets, settings).

Errors name the file, the line and the key, because recipes are written by hand and fed in by release pipelines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .errors import QuantforgeError
from .paths import find_definitions
from .settings import file_schema, from_file

# key -> expected type, or a nested schema for a mapping. Types are checked; unknown keys are errors. The build
# settings' keys (formats, eval.*, quantize.*, calibration.*, ...) come from settings.SETTINGS.
TARGETS_SCHEMA = {
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
}
SCHEMA: dict = {
    "name": str,
    "description": str,
    "model": str,
    **file_schema(),
    "targets": TARGETS_SCHEMA,
    # The model's size, from its config.json, so `build --plan-only` can plan it before anything is downloaded.
    "size": {
        "parameters": int,
        "hidden_size": int,
        "intermediate_size": int,
        "num_layers": int,
        "vocab_size": int,
        "tie_word_embeddings": bool,
        "dtype": str,
        "num_experts": int,  # a mixture of experts only
        "expert_intermediate_size": int,
    },
}
NOT_SETTINGS = ("name", "description", "model", "targets", "size")


@dataclass
class Recipe:
    name: str
    model: str
    path: Path | None = None
    description: str = ""
    targets: dict = field(default_factory=dict)
    size: dict = field(default_factory=dict)
    written: dict = field(default_factory=dict)  # the build settings as the file writes them (formats, eval: ...)

    def settings(self) -> dict:
        """name -> value of every build setting the recipe gives (see settings.SETTINGS)."""
        return from_file(self.written)

    def revision(self) -> str | None:
        return self.written.get("revision")

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "model": self.model,
            "path": str(self.path) if self.path else None,
            **self.written,
            "targets": self.targets,
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
    written = {key: value for key, value in data.items() if key not in NOT_SETTINGS}
    return Recipe(
        name=data.get("name", path.stem),
        model=data["model"],
        path=path,
        description=data.get("description", ""),
        targets=data.get("targets", {}),
        size=data.get("size", {}),
        written=written,
    )


def find_recipe(name: str) -> Recipe | None:
    path = known_recipes().get(name)
    return load_recipe(path) if path else None

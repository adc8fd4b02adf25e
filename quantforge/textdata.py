"""Texts by name or by file: the perplexity text and the calibration sets.

A name refers to a YAML definition in ``evals/text/`` or ``calibration/`` (a Hub data set loaded through
``datasets``, or text built into Python); anything that looks like a path is read as a local file: ``.txt``/``.raw``
as it is, ``.jsonl``/``.json`` by its ``text`` field (or the field named after ``:``, e.g. ``data.jsonl:content``).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib
import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from .errors import QuantforgeError
from .hub import hub_offline
from .paths import find_definitions

AUTO = "auto"
TEXT_KINDS = ("evals/text", "calibration")


@dataclass
class Text:
    name: str
    documents: list[str]
    source: str  # where it came from, for the card
    joiner: str = "\n\n"
    # The joiner that gives the data set's standard file (WikiText-2's rows, each ending in a newline, joined with
    # "" make wiki.test.raw), which llama-perplexity reads; None where the text is a file already.
    file_joiner: str | None = None

    def as_file(self) -> "Text":
        """The text as its standard file, for llama-perplexity's convention."""
        if self.file_joiner is None or self.file_joiner == self.joiner:
            return self
        return Text(self.name, self.documents, f"{self.source}, as its file", self.file_joiner)

    @property
    def joined(self) -> str:
        return self.joiner.join(self.documents)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.joined.encode()).hexdigest()

    def describe(self) -> dict:
        return {
            "name": self.name,
            "source": self.source,
            "documents": len(self.documents),
            "characters": len(self.joined),
            "sha256": self.sha256,
        }


def known_texts() -> dict[str, Path]:
    return find_definitions(*TEXT_KINDS)


def _read_local(spec: str) -> Text:
    path_text, _, field = spec.partition(":") if not Path(spec).exists() else (spec, "", "")
    path = Path(path_text).expanduser()
    if not path.exists():
        raise QuantforgeError(f"text file {path} does not exist")
    opener = gzip.open if path.suffix == ".gz" else open
    suffixes = "".join(path.suffixes[-2:])
    with opener(path, "rt", encoding="utf-8") as handle:
        if ".jsonl" in suffixes or ".json" in suffixes:
            key = field or "text"
            documents = []
            for line_number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    raise QuantforgeError(f"{path}:{line_number} is not a JSON object") from None
                if not isinstance(record, dict) or not isinstance(record.get(key), str):
                    raise QuantforgeError(f"{path}:{line_number} has no string field '{key}'")
                documents.append(record[key])
            return Text(path.name, documents, f"file {path}")
        return Text(path.name, [handle.read()], f"file {path}", joiner="")


def _load_definition(name: str, path: Path) -> Text:
    definition = yaml.safe_load(path.read_text()) or {}
    joiner = definition.get("join", "\n\n")
    if "builtin" in definition:
        module_name, _, function = definition["builtin"].partition(":")
        module = importlib.import_module(module_name)
        if function:
            documents = getattr(module, function)()
        else:  # a dict of texts, like pydoc_data.topics.topics
            topics = module.topics
            documents = [topics[key] for key in sorted(topics)]
        return Text(name, documents, f"python {definition['builtin']}", joiner)
    hub_offline()  # with no Hub in reach, datasets goes to its cache at once instead of retrying for ~25 s
    try:
        import datasets
    except ImportError:
        raise QuantforgeError(
            f"the text '{name}' is loaded through the datasets package: pip install datasets"
        ) from None
    kwargs = {"split": definition.get("split", "test")}
    if definition.get("data_files"):
        kwargs["data_files"] = definition["data_files"]
    try:
        rows = datasets.load_dataset(definition["dataset"], definition.get("config"), **kwargs)
    except Exception as exc:  # datasets raises many types for "not cached and no network"
        raise QuantforgeError(
            f"could not load the data set '{name}' ({definition['dataset']}) through datasets: "
            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}; give a local file instead "
            "(a .txt, or a .jsonl with a text field)"
        ) from None
    field = definition.get("field", "text")
    documents = [row[field] for row in rows]
    return Text(name, documents, f"datasets {definition['dataset']}", joiner, definition.get("file_join"))


def load_text(spec: str) -> Text:
    """Load a text by definition name or local path; ``auto`` is WikiText-2 where it can be had, else pydoc."""
    if spec == AUTO:
        try:
            return load_text("wikitext2")
        except QuantforgeError:
            return load_text("pydoc")
    definitions = known_texts()
    if spec in definitions:
        return _load_definition(spec, definitions[spec])
    if "/" in spec or "." in spec or Path(spec).exists():
        return _read_local(spec)
    raise QuantforgeError(
        f"unknown text '{spec}'; known: {', '.join(sorted(definitions))}, or give a local .txt/.jsonl file"
    )


# Modules whose docstrings are long, plain English; the list is fixed so the corpus is the same on every run.
_DOCSTRING_MODULES = (
    "argparse",
    "asyncio",
    "collections",
    "concurrent.futures",
    "contextlib",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email",
    "enum",
    "fractions",
    "functools",
    "heapq",
    "http.client",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "logging",
    "mailbox",
    "multiprocessing",
    "os",
    "pathlib",
    "pickle",
    "random",
    "re",
    "shutil",
    "socket",
    "sqlite3",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "textwrap",
    "threading",
    "typing",
    "unittest",
    "urllib.parse",
    "urllib.request",
    "uuid",
    "zipfile",
    "ast",
    "calendar",
    "codecs",
    "configparser",
    "copy",
    "doctest",
    "ftplib",
    "gettext",
    "glob",
    "gzip",
    "hashlib",
    "imaplib",
    "locale",
    "numbers",
    "operator",
    "optparse",
    "pdb",
    "pprint",
    "pydoc",
    "queue",
    "sched",
    "secrets",
    "selectors",
    "shelve",
    "smtplib",
    "ssl",
    "struct",
    "tempfile",
    "tokenize",
    "trace",
    "traceback",
    "wave",
    "weakref",
    "xml.dom.minidom",
)


def stdlib_docstrings() -> list[str]:
    """One document per standard-library module: its docstring and those of its public members."""
    import inspect

    documents = []
    for module_name in _DOCSTRING_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        parts = [inspect.getdoc(module) or ""]
        for member_name in sorted(dir(module)):
            if member_name.startswith("_"):
                continue
            member = getattr(module, member_name, None)
            if (inspect.isclass(member) or inspect.isfunction(member)) and getattr(
                member, "__module__", ""
            ) == module.__name__:
                doc = inspect.getdoc(member)
                if doc:
                    parts.append(doc)
        documents.append("\n\n".join(p for p in parts if p))
    return documents

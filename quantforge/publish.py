"""Publishing a finished run to the Hugging Face Hub: ``quantforge push`` and ``build --push-to-hub``.

Layout, as model releases do it: one repo per torch artifact (``ORG/NAME-GPTQ-Int4``, ``-AWQ``, ``-W8A8``: the
folder as written, with its model card), and one ``ORG/NAME-GGUF`` repo holding every GGUF file with a combined
card and a Modelfile per file (``--gguf-repos per-format`` gives each GGUF its own ``ORG/NAME-Q4_K_M-GGUF`` repo).
A GGUF file larger than ``--split-size`` is split in llama.cpp's own split format (``NAME-00001-of-00003.gguf``,
loaded by llama.cpp from the first shard) before upload.

All traffic goes through huggingface_hub (``create_repo``, ``create_commit``): its LFS or Xet upload skips what the
Hub already holds, so a push cut off half way resumes when run again, and ``push.json`` in the run folder records
each repo's commit so finished repos are not committed twice. The token is read by huggingface_hub (HF_TOKEN, or
the stored login); quantforge never reads it into its own records, logs or cards.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import QuantforgeError, one_line
from .fsutil import atomic_output, atomic_write_json, atomic_write_text, sha256_file
from .rundir import RunDir

PUSH_RECORD = "push.json"
GGUF_LAYOUTS = ("one", "per-format")
SIZE_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9}


@dataclass
class Upload:
    """One repo and the files that go into it (path in the repo -> file on disk)."""

    repo_id: str
    files: dict[str, Path] = field(default_factory=dict)
    formats: list[str] = field(default_factory=list)


def parse_size(text: str) -> int:
    """``2GB``, ``500M``, ``1.5G`` -> bytes (decimal units, as the Hub and llama.cpp's gguf-split count)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*", text.upper())
    if not match or float(match.group(1)) <= 0:
        raise QuantforgeError(f"--split-size {text}: give a positive size such as 2GB or 500MB")
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2)])


def check_repo_name(base: str) -> None:
    """A one-line refusal, before any work, of a name the Hub would refuse."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        if base.count("/") != 1:
            raise HFValidationError("not of the form ORG/NAME")
        validate_repo_id(base + "-GPTQ-Int4")  # the longest suffix we add must still be valid
    except HFValidationError:
        raise QuantforgeError(
            f"--push-to-hub {base}: not a valid Hub repo name; use ORG/NAME with letters, digits, '-', '_' and '.' "
            "(no '--' or '..', at most 96 characters with the format suffix)"
        ) from None


def check_token() -> None:
    from huggingface_hub import get_token

    if not get_token():
        raise QuantforgeError(
            "pushing to the Hub needs a token with write access: set HF_TOKEN or run 'hf auth login' (nothing was "
            "uploaded)"
        )


# ----------------------------------------------------------------------------------------------- GGUF split


def split_gguf(path: Path, max_bytes: int, out_dir: Path) -> list[Path]:
    """``path`` in llama.cpp's split format, shards of at most ``max_bytes`` of tensor data each (a shard holds at
    least one tensor), written atomically into ``out_dir``; an existing complete split is reused."""
    import gguf

    reader = gguf.GGUFReader(path)
    final = out_dir / path.stem
    if (final / "complete.json").exists():
        recorded = json.loads((final / "complete.json").read_text())
        if recorded == {"source_size": path.stat().st_size, "max_bytes": max_bytes}:
            return sorted(final.glob("*.gguf"))
    with atomic_output(final) as tmp:
        tmp.mkdir(parents=True)
        architecture = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
        writer = gguf.GGUFWriter(tmp / path.name, architecture, split_max_size=max_bytes)
        for item in reader.fields.values():
            if item.name == gguf.Keys.General.ARCHITECTURE or item.name.startswith("GGUF."):
                continue  # written by the writer itself
            value_type = item.types[0]
            sub_type = item.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(item.name, item.contents(), value_type, sub_type=sub_type)
        for tensor in reader.tensors:
            writer.add_tensor_info(
                tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type
            )
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for tensor in reader.tensors:
            writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
        writer.close()
        atomic_write_json(tmp / "complete.json", {"source_size": path.stat().st_size, "max_bytes": max_bytes})
    return sorted(final.glob("*.gguf"))


# ----------------------------------------------------------------------------------------------- what goes where


def _hub_suffix(entry: dict) -> str:
    from .backends import load_backends

    backend = load_backends().get(entry["backend"])
    fmt = backend.formats.get(entry["format"]) if backend else None
    return (fmt.hub_suffix if fmt and fmt.hub_suffix else "") or entry["format"]


def _gguf_file(run_dir: Path, entry: dict) -> Path:
    return sorted((run_dir / entry["artifact"]).glob("*.gguf"))[0]


def _quant_label(card: dict, entry: dict, gguf_file: Path) -> str:
    """What tells a GGUF apart from the others of its model: "Q4_K_M", "Q4_K_M-imat" (its name after the model's)."""
    prefix = card["model"]["name"] + "-"
    return gguf_file.stem[len(prefix) :] if gguf_file.stem.startswith(prefix) else entry["scheme"]


def _refuse_a_shared_name(upload: Upload, gguf_file: Path, entry: dict, names: dict[str, list[str]]) -> None:
    """Two files of one name in one repo: the second would silently replace the first. Runs made before each backend
    named its files apart can hold such a pair."""
    if gguf_file.name in upload.files:
        other = next(key for key, files in names.items() if gguf_file.name in files)
        raise QuantforgeError(
            f"{entry['key']} and {other} both made {gguf_file.name}, and one repo cannot hold both: delete "
            f"{gguf_file.parent} and run the same build again, which remakes it under a name of its own (nothing "
            "was uploaded)"
        )


def plan_uploads(run_dir: Path, card: dict, base: str, gguf_layout: str, split_bytes: int | None) -> list[Upload]:
    """The repos and files a push of this run's finished artifacts makes (GGUF splits written on the way)."""
    from .html import QUALITY_PNG
    from .modelcard import CARD_JSON, LICENSE_FILES, for_repo, write_gguf_repo_card

    complete = [e for e in card["formats"] if e.get("complete")]
    if not complete:
        raise QuantforgeError(f"{run_dir} has no finished artifact to push; run the build first")
    rundir = RunDir(run_dir)
    # every repo also gets the run's card (the model cards point to it) and its size-against-quality plot
    shared = {CARD_JSON: rundir.card}
    plot = QUALITY_PNG if (run_dir / QUALITY_PNG).exists() else None
    if plot:
        shared[plot] = run_dir / plot
    uploads: list[Upload] = []
    gguf_entries = [e for e in complete if e["family"] == "gguf"]
    for entry in complete:
        if entry["family"] == "gguf":
            continue
        folder = run_dir / entry["artifact"]
        files = {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}
        repo_id = f"{base}-{_hub_suffix(entry)}"
        if "README.md" in files:
            readme = rundir.publish() / f"{entry['key']}-README.md"
            atomic_write_text(readme, for_repo(files["README.md"].read_text(), folder.name, repo_id, plot))
            files["README.md"] = readme
        uploads.append(Upload(repo_id, {**files, **shared}, [entry["key"]]))
    groups = [gguf_entries] if gguf_layout == "one" else [[e] for e in gguf_entries]
    for group in groups:
        if not group:
            continue
        first_label = _quant_label(card, group[0], _gguf_file(run_dir, group[0]))
        repo_id = f"{base}-GGUF" if gguf_layout == "one" else f"{base}-{first_label}-GGUF"
        upload = Upload(repo_id, formats=[e["key"] for e in group])
        names: dict[str, list[str]] = {}
        labels: dict[str, str] = {}
        for entry in group:
            folder = run_dir / entry["artifact"]
            gguf_file = _gguf_file(run_dir, entry)
            labels[entry["key"]] = _quant_label(card, entry, gguf_file)
            _refuse_a_shared_name(upload, gguf_file, entry, names)
            if split_bytes and gguf_file.stat().st_size > split_bytes:
                shards = split_gguf(gguf_file, split_bytes, RunDir(run_dir).publish() / "split" / entry["key"])
                upload.files.update({shard.name: shard for shard in shards})
                names[entry["key"]] = [shard.name for shard in shards]
            else:
                upload.files[gguf_file.name] = gguf_file
                names[entry["key"]] = [gguf_file.name]
            if (folder / "Modelfile").exists():
                label = _quant_label(card, entry, gguf_file)
                upload.files[f"Modelfile.{label}" if len(group) > 1 else "Modelfile"] = folder / "Modelfile"
            for name in LICENSE_FILES:
                if (folder / name).exists():
                    upload.files[name] = folder / name
            upload.files.update(_remake_inputs(run_dir, card, entry))
        readme = rundir.publish() / f"{repo_id.split('/')[-1]}-README.md"
        atomic_write_text(readme, write_gguf_repo_card(card, group, repo_id, names, labels, plot))
        upload.files["README.md"] = readme
        upload.files.update(shared)
        uploads.append(upload)
    return uploads


def _remake_inputs(run_dir: Path, card: dict, entry: dict) -> dict[str, Path]:
    """What a GGUF publisher ships beside a file so that it can be remade or requantized: the importance matrix it
    was quantized with (llama.cpp's own file, as the run made it) and gguf-auto's tensor-type file. The matrix is
    in the run's work/ folder; a run copied without it pushes the files alone."""
    facts = entry.get("quantize") or {}
    files = {}
    if "--imatrix" in str(facts.get("quantizer", "")) or facts.get("reproduce"):
        matrix = RunDir(run_dir).intermediate(card["model"]["name"], "imatrix", ".gguf")
        if matrix.exists():
            files[matrix.name] = matrix
    types = run_dir / entry["artifact"] / "tensor-types.txt"
    if types.exists():
        files[types.name] = types
    return files


# ----------------------------------------------------------------------------------------------- the push


def _digests(upload: Upload) -> dict[str, str]:
    return {name: sha256_file(path) for name, path in sorted(upload.files.items())}


def _push_one(api, upload: Upload, private: bool, message: str) -> str:
    from huggingface_hub import CommitOperationAdd

    api.create_repo(upload.repo_id, private=private, exist_ok=True, repo_type="model")
    operations = [
        CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(path)) for name, path in upload.files.items()
    ]
    info = api.create_commit(upload.repo_id, operations=operations, commit_message=message, repo_type="model")
    return info.oid


def push_run(
    run_dir: Path,
    base: str,
    *,
    private: bool = False,
    gguf_layout: str = "one",
    split_bytes: int | None = None,
    log=print,
) -> dict:
    """Push every finished artifact of ``run_dir``; returns {repo_id: {url, commit, files, formats, skipped}}."""
    import httpx
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    check_repo_name(base)
    check_token()
    if gguf_layout not in GGUF_LAYOUTS:
        raise QuantforgeError(f"--gguf-repos {gguf_layout}: choose one of {', '.join(GGUF_LAYOUTS)}")
    card_path = RunDir(run_dir).card
    if not card_path.exists():
        raise QuantforgeError(f"{run_dir} holds no card.json: run 'quantforge build' first, then push")
    card = json.loads(card_path.read_text())
    uploads = plan_uploads(run_dir, card, base, gguf_layout, split_bytes)
    record_path = run_dir / PUSH_RECORD
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    api = HfApi()
    report = {}
    for upload in uploads:
        digests = _digests(upload)
        done = record.get(upload.repo_id)
        if done and done.get("files") == digests:
            log(f"{upload.repo_id}: pushed earlier (commit {done['commit'][:12]}), files unchanged")
            report[upload.repo_id] = {**done, "skipped": True}
            continue
        size = sum(path.stat().st_size for path in upload.files.values())
        log(f"pushing {', '.join(upload.formats)} to {upload.repo_id} ({len(upload.files)} files, {size / 1e6:.1f} MB)")
        try:
            commit = _push_one(
                api, upload, private, f"quantforge: {', '.join(upload.formats)} of {card['model']['name']}"
            )
        except HfHubHTTPError as exc:
            status = exc.response.status_code if exc.response is not None else None
            if status in (401, 403):
                raise QuantforgeError(
                    f"the Hub refused the token for {upload.repo_id} (HTTP {status}): use a token with write access "
                    "to that namespace; files on disk are intact"
                ) from None
            raise QuantforgeError(
                f"push to {upload.repo_id} failed ({one_line(exc)}); files on disk are intact: run the same command "
                "again to resume"
            ) from None
        except (OSError, RuntimeError, ValueError, httpx.HTTPError) as exc:  # dropped, refused, timed out, malformed
            cause = exc.__cause__ or exc
            raise QuantforgeError(
                f"push to {upload.repo_id} failed ({one_line(cause)}); files on disk are intact: run the same command "
                "again to resume (what the Hub already holds is not uploaded again)"
            ) from None
        record[upload.repo_id] = {
            "url": f"{api.endpoint}/{upload.repo_id}",
            "commit": commit,
            "files": digests,
            "formats": upload.formats,
            "private": private,
        }
        atomic_write_json(record_path, record)
        report[upload.repo_id] = {**record[upload.repo_id], "skipped": False}
    return report

"""Names in a run directory, in one place: the manifest's stage keys and the path of every file a run writes.

    runs/<model>/
      run.json                 the manifest: plan, one record per finished stage, failures
      source.json              what fetch resolved
      card.json card.md card.html
      artifacts/<key>/         one folder per format: the files its runtime loads, README.md, licence, Modelfile
      evals/<key>.json         per-window perplexity and KL; evals/tasks/<key>/<task>.json; evals/speed/<key>.json;
                               evals/kv-cache/<key>/<type>.json (the file with a quantized KV cache)
      work/                    files shared by stages: evaluation windows, reference logits, calibration tokens,
                               host facts, probe prompt, intermediates, checkpoints/<key>/, progress/
      logs/                    library output, a file per stage
      publish/                 files made for a Hub upload (split GGUF shards, the GGUF repo's README)

``<key>`` is a format's key on the card (``gguf-q4km``, ``gguf-q4km@imatrix``); ``reference`` names the unquantized
model where a stage runs for it too (tasks, speed).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MANIFEST_NAME = "run.json"
SOURCE_NAME = "source.json"
CARD_JSON, CARD_MARKDOWN, CARD_HTML = "card.json", "card.md", "card.html"

# Stages that run once per model, before any format.
FETCH, TOKENS, REFERENCE, CALIBRATION, HOST = "fetch", "tokens", "reference", "calibration", "host"


def intermediate_stage(name: str) -> str:
    return f"intermediate/{name}"


def quantize_stage(key: str) -> str:
    return f"quantize/{key}"


def evaluate_stage(key: str) -> str:
    return f"evaluate/{key}"


def kv_cache_stage(key: str, kv_cache: str = "") -> str:
    """``key``'s file evaluated with a quantized KV cache (--kv-cache); without a type, the prefix of all of them."""
    return f"kv-cache/{key}/{kv_cache}"


def tasks_stage(key: str, task: str = "") -> str:
    """One lm-eval task of ``key``; without a task, the prefix of all of them."""
    return f"tasks/{key}/{task}"


def speed_stage(key: str) -> str:
    return f"speed/{key}"


@dataclass(frozen=True)
class RunDir:
    """The files of one run directory (``root``), by what they hold."""

    root: Path

    @property
    def manifest(self) -> Path:
        return self.root / MANIFEST_NAME

    @property
    def source(self) -> Path:
        return self.root / SOURCE_NAME

    @property
    def card(self) -> Path:
        return self.root / CARD_JSON

    @property
    def work(self) -> Path:
        return self.root / "work"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def eval_windows(self) -> Path:
        return self.work / "eval-windows.npy"

    @property
    def reference(self) -> Path:
        return self.work / "reference.npz"

    @property
    def calibration(self) -> Path:
        return self.work / "calibration.npy"

    @property
    def host(self) -> Path:
        return self.work / "host.json"

    @property
    def probe_prompt(self) -> Path:
        return self.work / "probe-prompt.npy"

    def intermediate(self, model_name: str, name: str, suffix: str) -> Path:
        return self.work / f"{model_name}-{name}{suffix}"

    def artifact(self, key: str) -> Path:
        return self.root / "artifacts" / key

    def checkpoint(self, key: str) -> Path:
        return self.work / "checkpoints" / key

    def progress(self, key: str, inputs_digest: str) -> Path:
        """Partial results of an interrupted stage, valid only for the same inputs."""
        return self.work / "progress" / f"{key}-{inputs_digest[:16]}.npz"

    def evaluation(self, key: str) -> Path:
        return self.root / "evals" / f"{key}.json"

    def kv_cache_evaluation(self, key: str, kv_cache: str) -> Path:
        return self.root / "evals" / "kv-cache" / key / f"{kv_cache}.json"

    def tasks(self, key: str, task: str) -> Path:
        return self.root / "evals" / "tasks" / key / f"{task}.json"

    def speed(self, key: str) -> Path:
        return self.root / "evals" / "speed" / f"{key}.json"

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def publish(self) -> Path:
        return self.root / "publish"

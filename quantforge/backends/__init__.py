"""Backends: the code that makes formats with one library each, found by name through entry points.

A backend module must import its heavy library (torch, llama_cpp, gptqmodel, ...) inside its methods, never at
module level: ``quantforge formats`` loads every backend to list what it offers, and must stay fast.

Third parties add a backend by declaring an entry point in the ``quantforge.backends`` group that names a
``Backend`` subclass; adding a format means one new module that subclasses ``Backend`` and lists its ``Format``s.
A backend owns everything about its artifacts: how they are made (``quantize``), loaded for evaluation
(``open_runner``), timed in their runtime (``probe_target``, ``probe``) and served (``deployment``, the commands
on their model card); runtimes are known from the loaded backends' formats.
"""

from __future__ import annotations

import abc
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ClassVar, Protocol

import numpy as np

from .. import install_hint
from ..errors import QuantforgeError

if TYPE_CHECKING:
    from ..source import SourceModel

ENTRY_POINT_GROUP = "quantforge.backends"


@dataclass(frozen=True)
class Format:
    """A user-facing format name with what it is and where it runs."""

    name: str
    family: str  # "gguf": a single .gguf file; "hf": a Hugging Face folder with quantization_config
    scheme: str  # the name its runtime uses, e.g. "Q4_K_M" or "W4A16 g128"
    runtimes: tuple[str, ...]
    nominal_bits: float  # for disk estimates before anything exists; the card uses measured bits per weight
    description: str = ""
    # The Hub repo suffix releases use for this format (ORG/NAME-GPTQ-Int4); GGUF files share one ORG/NAME-GGUF repo
    hub_suffix: str = ""
    # The GPU generations (gpus.GENERATIONS) whose kernels run it as made; empty: every one. And those that run its
    # weights alone (FP8 on Turing and Ampere: vLLM's weight-only Marlin kernel, activations left unquantized).
    gpu_generations: tuple[str, ...] = ()
    gpu_weight_only: tuple[str, ...] = ()


class LogitsRunner(Protocol):
    """A loaded artifact that returns next-token logits for a window of token ids."""

    runtime: str

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        """[n, vocab] float32 logits of every position of the window. A runner may also offer
        ``scored_logits(tokens, first=0)``: the logits of positions ``first`` to the last but one, as consecutive
        blocks of rows, each valid only until the next is asked for; the evaluation uses it when present, so a
        window's logits need not be held whole (and ``first`` lets the output layer skip the positions a scoring
        convention leaves out). And ``last_logits(tokens, rows)``: the last ``rows`` positions' logits alone, which the
        tasks use when present (a continuation needs a few rows, and the output layer need run on those only)."""
        ...

    def close(self) -> None: ...


@dataclass
class QuantizeJob:
    """Everything a backend needs to produce one artifact."""

    source: "SourceModel"
    format: Format
    settings: dict
    out: Path  # a temporary path; the backend creates it (a folder), the pipeline renames it when complete
    intermediate: Callable[[str], Path]  # name -> path of a shared file made before this job (Backend.intermediates)
    log_dir: Path  # where library output (per-tensor lines and such) goes instead of the terminal
    calibration: Path | None = None  # the run's calibration tokens, [samples, seqlen] int32 (.npy)
    checkpoint_dir: Path | None = None  # survives a killed run, for libraries that resume layer by layer
    threads: int = 2
    device: str = "cpu"  # where torch quantizers run: cpu or cuda:N (device.resolve_device)
    dtype: str = "bfloat16"  # this format's calibration arithmetic (pipeline.calibration_dtype); bf16 is saved
    log: Callable[[str], None] = print


@dataclass(frozen=True)
class Intermediate:
    """A file shared by several formats of a run (the F16 GGUF, an importance matrix).

    ``build`` gets a ``QuantizeJob`` whose ``out`` is the file to write (a temporary name) and returns facts; its
    stage's inputs are the source, the intermediates named in ``needs`` and, when ``uses_calibration``, the run's
    calibration set (then ``job.calibration`` holds it).
    """

    suffix: str
    build: Callable[[QuantizeJob], dict | None]
    needs: tuple[str, ...] = ()
    uses_calibration: bool = False


@dataclass
class Deployment:
    """What an artifact's model card says about running it (written by ``Backend.deployment``)."""

    library: str  # the Hub's library_name: "gguf", "transformers", ...
    tags: list[str]  # Hub tags beyond quantforge's own, e.g. the quantization method
    quant_config: dict  # the quantization_config the card's Quantization table shows ({} when none)
    usage: list[str]  # Markdown lines under "Usage": commands that serve and load the artifact


class Backend(abc.ABC):
    """Base class for backends. Subclasses set ``name``, ``formats`` and ``requires`` and implement the hooks."""

    name: ClassVar[str] = ""
    formats: ClassVar[dict[str, Format]] = {}
    # Importable modules this backend needs, and the pip extra that installs them.
    requires: ClassVar[tuple[str, ...]] = ()
    extra: ClassVar[str] = ""
    # Formats this backend makes only when asked with --backend (another backend is their default).
    alternative_for: ClassVar[frozenset[str]] = frozenset()
    # Formats of its family this backend does not make, and why (the one line a user asking it for one reads).
    refuses: ClassVar[dict[str, str]] = {}
    # Whether quantize() reads the run's calibration set (job.calibration).
    needs_calibration: ClassVar[bool] = False
    # Formats whose calibration runs in the build's chosen arithmetic (job.dtype, see device.quantizer_dtype);
    # the others run in the dtype their library needs.
    follows_quantize_dtype: ClassVar[frozenset[str]] = frozenset()
    # A regex with groups (done, total) for the library's progress lines in its log, shown as our progress bar.
    progress_pattern: ClassVar[str | None] = None
    # The importable module of the library that loads this backend's artifacts for evaluation (named, with its
    # version, when evaluation fails); quantization failures name the first of ``requires``.
    runtime_module: ClassVar[str] = "transformers"
    # Whether quantize() loads the model in transformers: its process then imports transformers first, without
    # the packages it never uses (memory.import_transformers_slim). llama.cpp's quantizers need no torch at all.
    quantizes_in_transformers: ClassVar[bool] = True
    # Whether quantize() searches by measuring candidates: the build then hands it the run's evaluation windows,
    # reference and targets (``job.settings["search"]``), made before any quantize stage.
    searches: ClassVar[bool] = False

    def cost_model(self, fmt: Format) -> str:
        """Which of the resource plan's measured cost models prices making and running ``fmt``: "gguf" (llama.cpp),
        "mlx", or a torch quantizer's (resources.QUANTIZER_LIBRARY: "gptq", "awq", "int8", "fp8", "fp4", "nvfp4")."""
        return "gguf" if fmt.family == "gguf" else "gptq"

    def kv_cache_types(self, fmt: Format) -> dict[str, float]:
        """The quantized KV-cache types the runtime of ``fmt`` offers, each with its bytes per cached value (2 for
        the default 16-bit cache). ``open_runner`` takes ``kv_cache=TYPE`` for these, and the build measures what
        each asked one (--kv-cache) costs in KL on the evaluation's windows. None by default."""
        return {}

    def calibrates(self, fmt: Format) -> bool:
        """Whether quantize() reads the run's calibration set for ``fmt`` (a backend may make data-free formats)."""
        return self.needs_calibration

    def unavailable_reason(self) -> str | None:
        """Why this backend cannot run on this host, or None. Must not import the heavy library."""
        missing = [module for module in self.requires if importlib.util.find_spec(module) is None]
        if missing:
            return f"{', '.join(missing)} not installed ({install_hint(self.extra)})"
        return None

    def check(self, source: "SourceModel", fmt: Format, settings: dict) -> list[str]:
        """Problems with the user's input that would make quantization fail: the build is refused up front."""
        return []

    def unsupported(self, source: "SourceModel", fmt: Format) -> str | None:
        """Why the library cannot make this format for this model (its architecture, say), or None.

        Unlike ``check``, this fails only this format, up front, and the build goes on with the others.
        """
        return None

    def library(self, stage: str = "quantize") -> str:
        """The library (with its version) that runs ``stage`` ("quantize" or "evaluate"), for failure reports."""
        module = self.runtime_module if stage == "evaluate" else (self.requires[0] if self.requires else self.name)
        return library_version(module)

    @abc.abstractmethod
    def quantize(self, job: QuantizeJob) -> dict:
        """Write the artifact into ``job.out`` and return facts about it (settings actually used, fallbacks)."""

    def artifact_file(self, artifact_dir: Path) -> Path:
        """The file a runtime loads (for GGUF), or the folder itself (HF formats)."""
        return artifact_dir

    def intermediates(self, fmt: Format) -> dict[str, "Intermediate"]:
        """Files several formats share, in the order they are made: each made and recorded once per run before
        the first quantize stage that needs it; ``QuantizeJob.intermediate(name)`` then gives its path."""
        return {}

    @abc.abstractmethod
    def open_runner(self, artifact_dir: Path, *, context: int, threads: int, device: str = "cpu") -> LogitsRunner:
        """Load the artifact from disk for evaluation (torch work on ``device``)."""

    def probe_target(self, artifact_dir: Path) -> tuple[str, Path] | str:
        """(runtime, path) for the decode-speed probe in the format's own runtime, or why this host has none."""
        return f"no runtime for {self.name} artifacts on this host"

    def probe(
        self,
        runtime: str,
        path: Path,
        prompt: list[int],
        gen_tokens: int,
        threads: int,
        runs: int,
        device: str = "cpu",
    ) -> dict:
        """Time ``runs`` greedy generations of ``gen_tokens`` after ``prompt`` in ``runtime`` on ``device`` (the
        speed probe's own process calls this): prompt_tps, decode_tps, ttft_s, tpot_s and such, and the device it
        ran on. quantforge's probes know llama.cpp, transformers and vLLM; a backend with a runtime of its own
        overrides this (a ``device`` parameter is optional there)."""
        from ..probe import PROBES

        if runtime not in PROBES:
            raise QuantforgeError(f"backend {self.name} names runtime '{runtime}' for its speed probe but has no probe")
        return PROBES[runtime](path, prompt, gen_tokens, threads, runs, device)

    def deployment(self, folder: Path, card: dict, entry: dict, chat: tuple[str | None, dict]) -> Deployment:
        """How to run the artifact in ``folder``, for its model card; may write side files there (an Ollama
        Modelfile). ``entry`` is its card entry; ``chat`` the source's chat template and special tokens."""
        return plain_deployment(folder, entry)


def has_own_probe(backend: Backend) -> bool:
    """Whether the backend overrides ``probe``; the probe process of one that does not loads no backend at all, so
    its peak memory is the runtime's and the model's alone."""
    return type(backend).probe is not Backend.probe


def plain_deployment(folder: Path, entry: dict) -> Deployment:
    """A model card's usage for a backend that says nothing of serving: the runtimes its format runs in."""
    runtimes = ", ".join(f"`{runtime}`" for runtime in entry["runtimes"])
    return Deployment(entry["family"], [], {}, [f"Runs in {runtimes}: load the files of `{folder.name}`."])


def library_version(module: str) -> str:
    """``gptqmodel 7.6.0`` for an importable module name, from the installed distribution's metadata."""
    distributions = importlib.metadata.packages_distributions().get(module) or [module]
    try:
        return f"{distributions[0]} {importlib.metadata.version(distributions[0])}"
    except importlib.metadata.PackageNotFoundError:
        return module


def load_backends() -> dict[str, Backend]:
    backends: dict[str, Backend] = {}
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        cls = entry.load()
        backend = cls()
        backends[backend.name or entry.name] = backend
    return backends


def load_backend(name: str) -> Backend:
    """One backend by name (the speed probe's process, which times that backend's artifact)."""
    backends = load_backends()
    if name not in backends:
        raise QuantforgeError(f"unknown backend '{name}'; known backends: {', '.join(sorted(backends))}")
    return backends[name]


def known_runtimes(backends: dict[str, Backend] | None = None) -> tuple[str, ...]:
    """ "any" and every runtime a format of the loaded backends runs in."""
    backends = backends if backends is not None else load_backends()
    return ("any", *sorted({r for backend in backends.values() for f in backend.formats.values() for r in f.runtimes}))


@dataclass(frozen=True)
class Choice:
    """One artifact of a run: a format made by a backend; ``key`` names it in the run directory and on the card."""

    format: Format
    backend: Backend
    key: str


def default_backend_name(format_name: str, backends: dict[str, Backend]) -> str:
    makers = [name for name, backend in backends.items() if format_name in backend.formats]
    preferred = [name for name in makers if format_name not in backends[name].alternative_for]
    return (preferred or makers)[0]


def canonical_format_name(name: str, backends: dict[str, Backend]) -> str:
    """A format's own name, from it or from the scheme its runtime knows it by: llama.cpp's ``Q4_K_M``, ``q4_k_m``
    or ``gguf-Q4_K_M`` are ``gguf-q4km``. Names that match nothing are returned as given."""
    formats = {f.name: f for backend in backends.values() for f in backend.formats.values()}
    if name in formats:
        return name
    wanted = name.upper().removeprefix("GGUF-")
    matches = {f.name for f in formats.values() if f.family == "gguf" and f.scheme.upper() == wanted}
    return matches.pop() if len(matches) == 1 else name


def resolve_formats(
    names: list[str], backend_names: list[str] | None, backends: dict[str, Backend] | None = None
) -> list[Choice]:
    """Turn ``--formats`` and ``--backend`` into the list of artifacts to make, or raise a one-line error."""
    backends = backends if backends is not None else load_backends()
    known = sorted({f for backend in backends.values() for f in backend.formats})
    for backend_name in backend_names or []:
        if backend_name not in backends:
            raise QuantforgeError(f"unknown backend '{backend_name}'; known backends: {', '.join(sorted(backends))}")
    choices: list[Choice] = []
    for asked in names:
        name = canonical_format_name(asked, backends)
        if name not in known:
            raise QuantforgeError(
                f"unknown format '{asked}'; known formats: {', '.join(known)} (see 'quantforge formats'), or "
                "llama.cpp's own names such as Q4_K_M"
            )
        for backend_name in backend_names or []:
            why = backends[backend_name].refuses.get(name)
            if why and not any(name in backends[b].formats for b in backend_names):
                raise QuantforgeError(f"backend '{backend_name}' does not make {name}: {why}")
        default = default_backend_name(name, backends)
        wanted = [b for b in (backend_names or []) if name in backends[b].formats] or [default]
        for backend_name in wanted:
            backend = backends[backend_name]
            key = name if backend_name == default else f"{name}@{backend_name}"
            choices.append(Choice(backend.formats[name], backend, key))
    if backend_names:
        unused = [b for b in backend_names if not any(c.backend.name == b for c in choices)]
        if unused:
            raise QuantforgeError(
                f"backend '{unused[0]}' makes none of the formats asked for ({', '.join(names)}); "
                f"it makes: {', '.join(sorted(backends[unused[0]].formats))}"
            )
    return choices

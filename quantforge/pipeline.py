"""``quantforge build``: fetch -> tokens -> reference -> quantize[fmt] -> evaluate[fmt] -> card.

Each stage is a plain function run through ``manifest.run_stage``: it declares its inputs (upstream digests and
settings) and its output files, writes them atomically, and is skipped on a re-run when its inputs are unchanged
and its outputs are still on disk. The card is re-rendered from the manifest at the end of every build.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np

from . import __version__, install_hint
from .backends import Choice, QuantizeJob, has_own_probe, known_runtimes, load_backends, resolve_formats
from .calibration import CalibrationSettings
from .card import write_card
from .decide import Targets
from .errors import QuantforgeError, StageFailed, interrupts_kept
from .evaluate import (
    EvalSettings,
    NonFiniteLogits,
    load_reference,
    make_windows,
    save_reference,
    score_artifact,
    score_reference,
    scored_logit_blocks,
)
from .fsutil import atomic_output, atomic_write_json, remove_path
from .logs import capture_output, follow_progress
from .manifest import Manifest, RunLock, clean_partials, run_stage
from .memory import cuda_used_bytes, import_transformers_slim, watch_gpu
from .quantize_process import quantize_in_child
from .recipes import Recipe, find_recipe, known_recipes, load_recipe
from .rundir import (
    CALIBRATION,
    FETCH,
    HOST,
    REFERENCE,
    TOKENS,
    RunDir,
    evaluate_stage,
    intermediate_stage,
    kv_cache_stage,
    quantize_stage,
    speed_stage,
    tasks_stage,
)
from .settings import BY_NAME as SETTING_NAMES
from .settings import check as check_settings
from .settings import resolve as resolve_settings
from .source import ModelSpec, SourceModel, fetch, parse_model_ref
from .ui import UI


@dataclass
class BuildRequest:
    """What the user asked for: the model, where the run goes, and the build settings given on the command line
    or in a release file (``settings``: name -> value, None or absent = the recipe's value or the default; see
    settings.SETTINGS). ``request.<setting name>`` reads one of them."""

    model: str | None
    out: Path | None = None
    recipe_file: Path | None = None
    force: bool = False
    targets: dict = field(default_factory=dict)  # overrides of the recipe's targets (see decide.Targets)
    settings: dict = field(default_factory=dict)
    command: str = "quantforge build"

    def __getattr__(self, name: str):
        if name in SETTING_NAMES:
            return self.__dict__.get("settings", {}).get(name)
        raise AttributeError(name)


@dataclass
class Plan:
    """Everything resolved from the request before any heavy work: errors in it cost the user nothing."""

    spec: ModelSpec
    recipe: Recipe | None
    choices: list[Choice]
    eval: EvalSettings
    tasks: dict  # names, data (folder), data_files (name -> sha256), limit
    speed: dict | None  # prompt_tokens, gen_tokens, runs; None when the probe is off
    calibration: CalibrationSettings
    quantize: dict  # settings every backend reads: group_size ("auto" or a number), act_order
    targets: Targets
    run_dir: Path
    threads: int
    request: BuildRequest
    device: str = "cpu"  # where torch work runs, resolved from --device
    settings: dict = field(default_factory=dict)  # every build setting, resolved (settings.SETTINGS)

    @property
    def needs_calibration(self) -> bool:
        return any(c.backend.calibrates(c.format) for c in self.choices)

    def to_json(self) -> dict:
        return {
            "command": self.request.command,
            "model": {
                "kind": self.spec.kind,
                "target": self.spec.target,
                "name": self.spec.name,
                "revision": self.spec.revision,
            },
            "recipe": self.recipe.to_json() if self.recipe else None,
            "artifacts": {
                c.key: {
                    "format": c.format.name,
                    "scheme": c.format.scheme,
                    "backend": c.backend.name,
                    "family": c.format.family,
                    "runtimes": list(c.format.runtimes),
                    "gpu_generations": list(c.format.gpu_generations),
                    "gpu_weight_only": list(c.format.gpu_weight_only),
                }
                for c in self.choices
            },
            "eval_settings": self.eval.to_json(),
            "tasks": {k: (str(v) if k == "data" and v else v) for k, v in self.tasks.items()},
            "speed": self.speed,
            "calibration": self.calibration.to_json() if self.needs_calibration else None,
            "quantize": self.quantize,
            "targets": self.targets.to_json(),
            "threads": self.threads,
            "device": self.device,
            "trust_remote_code": bool(self.settings.get("trust_remote_code")),
            "allow_pickle": bool(self.settings.get("allow_pickle")),
        }


def _first(*values):
    return next((v for v in values if v is not None), None)


def make_plan(request: BuildRequest) -> Plan:
    recipe = None
    if request.recipe_file is not None:
        recipe = load_recipe(request.recipe_file)
    elif request.model in known_recipes():
        recipe = find_recipe(request.model)
    if request.model is None and recipe is None:
        raise QuantforgeError("name a model (a recipe, a Hub id, a local folder) or pass --recipe FILE")
    if recipe is not None and (request.model is None or request.model == recipe.name):
        spec = parse_model_ref(recipe.model, name=recipe.name, revision=_first(request.revision, recipe.revision()))
    else:
        spec = parse_model_ref(request.model, revision=request.revision)
    if spec.kind == "unknown":
        raise QuantforgeError(
            f"unknown model '{spec.target}': not a recipe ({', '.join(sorted(known_recipes()))}), "
            "not an existing folder, and not a Hub id of the form org/name"
        )
    values = resolve_settings(request.settings, recipe.settings() if recipe else {})
    check_settings(values)
    choices = resolve_formats(values["formats"], values["backends"], load_backends())
    eval_settings = EvalSettings(
        text=values["eval_text"],
        context=values["ppl_context"],
        windows=values["ppl_windows"],
        scoring=values["ppl_scoring"],
    )
    calibration = CalibrationSettings(
        dataset=values["calibration"],
        samples=values["calib_samples"],
        seqlen=values["calib_seqlen"],
        seed=values["calib_seed"],
    )
    group_size = values["group_size"]
    if str(group_size) != "auto" and not str(group_size).isdigit():
        raise QuantforgeError(f"--group-size must be a number or 'auto', not {group_size!r}")
    quantize = {
        "group_size": "auto" if str(group_size) == "auto" else int(group_size),
        "act_order": bool(values["act_order"]),
        "layer_resume": bool(values["layer_resume"]),
        "dtype": values["quantize_dtype"],
    }
    targets = Targets(**{**(recipe.targets if recipe else {}), **request.targets})
    problems = targets.problems(known_runtimes())
    if problems:
        raise QuantforgeError(problems[0])
    if targets.gpu:
        from .deploy import parse_gpu

        parse_gpu(targets.gpu)
    run_dir = (request.out or Path("runs") / spec.name).resolve()
    if run_dir.exists() and not run_dir.is_dir():
        raise QuantforgeError(f"--out {run_dir} is a file; give a folder for the run (it is created when missing)")
    threads = values["threads"] or os.cpu_count() or 1
    for choice in choices:
        reason = choice.backend.unavailable_reason()
        if reason:
            raise QuantforgeError(f"format {choice.format.name} needs backend {choice.backend.name}: {reason}")
    check_kv_caches(values["kv_cache"] or [], choices)
    tasks = plan_tasks(values)
    speed = None
    if values["speed"]:
        speed = {
            "prompt_tokens": min(values["prompt_tokens"], eval_settings.context),
            "gen_tokens": values["gen_tokens"],
            "runs": 3,
        }
        if speed["prompt_tokens"] < 1 or speed["gen_tokens"] < 2:
            raise QuantforgeError("--prompt-tokens must be at least 1 and --gen-tokens at least 2")
    from .device import resolve_device

    device = resolve_device(values["device"])
    return Plan(
        spec,
        recipe,
        choices,
        eval_settings,
        tasks,
        speed,
        calibration,
        quantize,
        targets,
        run_dir,
        threads,
        request,
        device,
        values,
    )


def check_kv_caches(asked: list[str], choices: list[Choice]) -> None:
    """Each asked KV-cache type is one that a chosen format's runtime offers (one line otherwise)."""
    offered: dict[str, None] = {}
    for choice in choices:
        offered.update(dict.fromkeys(choice.backend.kv_cache_types(choice.format)))
    unknown = [kv for kv in asked if kv not in offered]
    if unknown and not offered:
        raise QuantforgeError(
            f"--kv-cache {','.join(asked)}: none of the formats asked runs where quantforge can quantize the KV "
            "cache (llama.cpp's: add a GGUF format, or leave --kv-cache out)"
        )
    if unknown:
        raise QuantforgeError(f"unknown --kv-cache type {unknown[0]!r}: use {', '.join(offered)}")


def plan_tasks(values: dict) -> dict:
    """Which lm-eval tasks run, on what data; checked now so a bad task name costs nothing."""
    from .fsutil import sha256_file
    from .tasks import DEFAULT_TASKS, data_file

    names, data = values["tasks"], values["tasks_data"]
    if names is None and data is not None:
        names = list(DEFAULT_TASKS)
    names = names or []
    limit = values["limit"]
    if limit is not None and limit < 1:
        raise QuantforgeError("--limit must be at least 1")
    files = {name: sha256_file(data_file(name, data)) for name in names}
    if names and importlib.util.find_spec("lm_eval") is None:
        raise QuantforgeError("--tasks needs lm-evaluation-harness, which is not installed: " + install_hint("tasks"))
    return {"names": names, "data": data, "data_files": files, "limit": limit}


REFERENCE_FORMAT = "top64+tail64"  # what reference.npz holds (see evaluate.py); part of the reference's inputs
TASK_CONTEXT = 1024  # tokens a runner must take for task requests (longer ones keep their last tokens)


class LazyRunner:
    """Loads a model for evaluation on first use, so stages that are already done never pay for the load."""

    def __init__(self, opener, context: int):
        self.opener = opener
        self.context = context
        self.runner = None

    def get(self):
        if self.runner is None:
            self.runner = self.opener()
        return self.runner

    def __enter__(self) -> "LazyRunner":
        return self

    def __exit__(self, *exc) -> None:
        if self.runner is not None:
            self.runner.close()
            self.runner = None


@dataclass(frozen=True)
class Prepared:
    """What every format of a run shares, as the prepare stages made it: the evaluation windows, the stored
    reference, the calibration set (None when no format calibrates)."""

    windows: np.ndarray
    reference: Path
    calibration: Path | None


@dataclass(frozen=True)
class Made:
    """What one format's quantize stage made: its folder, the bytes of its weight tensors (for the roofline), and the
    manifest key whose output digest the stages that measure it take as input."""

    folder: Path
    tensor_bytes: int
    stage: str


class Build:
    """One build of one model into a run directory.

    Run order: ``session`` (lock, fetch, checks, plan) -> ``prepare`` (tokens, reference and its tasks and speed,
    calibration) -> per format ``make`` (intermediates, quantize) and ``measure`` (evaluate, tasks, speed) -> ``card``.
    Each stage runs once per process; later stages get what earlier ones made as arguments (``Prepared``), or, in a
    release unit that did not prepare, from the paths the manifest recorded.
    """

    def __init__(self, plan: Plan, ui: UI):
        self.plan = plan
        self.ui = ui
        self.run_dir = plan.run_dir
        self.paths = RunDir(plan.run_dir)
        self.manifest: Manifest | None = None
        self.source: SourceModel | None = None
        self._intermediates_made: set[str] = set()  # shared files staged in this process (one stage per name)
        self._host: dict | None = None
        self.failures: dict[str, dict] = {}  # format key -> what failed (see failures.describe_failure)
        self.stage_failures: dict[str, dict] = {}  # shared stage key -> what failed in it (see shared_stage)
        self._host_speed = None  # resources.HostSpeed, measured once per build

    # -- the whole build, in run order ---------------------------------------------------------------------------------

    def run(self) -> dict:
        with self.session():
            prepared = self.prepare()
            for choice in self.plan.choices:
                try:
                    made = self.make(choice, prepared)
                    self.measure(choice, prepared, made)
                except StageFailed as failure:
                    if failure.record.get("stage") != "check":  # those were told up front
                        self.ui.log(f"[red]✗[/red] {failure}")
                    self.failures[choice.key] = failure.record
                else:
                    self.failures.pop(choice.key, None)
                self.record_failures()
        return self.card()

    def run_unit(self, unit: str, key: str | None = None) -> dict:
        """One unit of a release: "prepare", "quantize" or "evaluate" (of the format ``key``), or "card".

        Units of one model wait for each other's hold on the run directory, so they may be scheduled at once.
        """
        choice = next((c for c in self.plan.choices if c.key == key), None) if key else None
        if key and choice is None:
            raise QuantforgeError(f"no format '{key}' in the plan of {self.run_dir}")
        with self.session(wait=True):
            if unit == "prepare":
                self.prepare()
            elif unit in ("quantize", "evaluate"):
                self.failures = {**(self.manifest.data.get("failures") or {}), **self.failures}
                try:
                    if unit == "quantize":
                        self.make(choice, self.prepared_earlier())
                    else:
                        self.measure(choice, self.prepared_earlier(), self.made_earlier(choice))
                except StageFailed as failure:
                    self.failures[choice.key] = failure.record
                    raise
                else:
                    if unit == "evaluate":
                        self.failures.pop(choice.key, None)
                finally:
                    self.record_failures()
        return self.card() if unit == "card" else {"unit": unit, "key": key}

    @contextlib.contextmanager
    def session(self, wait: bool = False):
        """Hold the run directory, clean what a killed run left, fetch and check the model, record the plan."""
        with RunLock(self.run_dir, wait=wait) as lock, self.ui:
            if lock.took_over_from:
                self.ui.log(f"took over the lock of a run that is no longer alive (pid {lock.took_over_from})")
            removed = clean_partials(self.run_dir)
            if removed:
                names = ", ".join(str(p.relative_to(self.run_dir)) for p in removed[:3])
                self.ui.log(f"removed {len(removed)} half-written file(s) left by an interrupted run: {names}")
            self.manifest = Manifest.open(self.run_dir)
            self.stage_failures = dict(self.manifest.data.get("stage_failures") or {})
            self.precheck_hub_download()
            self.source = self.fetch()
            import_transformers_slim()  # before the first model or tokenizer class: 0.2 GB less
            self.check_config_readable()
            self.check_backends()
            self.check_same_model()
            self.failures = self.unsupported_formats()
            self.parameters = self.source.config.get("parameters") or 0
            self.plan_resources()
            # Only now, with the input checked, does this build touch the run's manifest.
            self.manifest.data["plan"] = {**self.plan.to_json(), "parameters": self.parameters}
            self.manifest.data["quantforge_version"] = __version__
            self.manifest.data["resource_plan"] = self.resource_plan
            self.record_fetch()
            watch_gpu(cuda_used_bytes(self.plan.device) if self.plan.device.startswith("cuda") else None)
            try:
                yield
            finally:
                watch_gpu(None)
            self.manifest.save()

    def prepare(self) -> Prepared:
        """What every format of the run shares: evaluation tokens, the reference, the calibration set.

        A library failing in the tokens or the reference stops the build (nothing can be compared); in the
        reference's tasks or speed probe it leaves those figures out; in the calibration set it fails the formats
        that calibrate. Each is one line with the library and the log (see ``shared_stage``)."""
        with self.shared_stage(TOKENS, "transformers", fatal=True):
            windows = self.tokens()
        with LazyRunner(self.open_reference_runner, TASK_CONTEXT) as runner:
            with self.shared_stage(REFERENCE, "transformers", fatal=True):
                reference = self.reference(windows, runner)
            with self.shared_stage(tasks_stage(REFERENCE), "lm_eval", fatal=False):
                self.tasks(REFERENCE, runner, FETCH)
        if self.plan.speed:
            from .artifacts import tensor_bytes

            with self.shared_stage(speed_stage(REFERENCE), "transformers", fatal=False):
                weights = tensor_bytes(self.source.path)
                self.speed(REFERENCE, ("transformers", self.source.path), weights, windows[0], FETCH)
        calibration = None
        with self.shared_stage(CALIBRATION, "transformers", fatal=False):
            calibration = self.calibration()
        if CALIBRATION in self.stage_failures:
            self.fail_calibrating_formats(self.stage_failures.pop(CALIBRATION))
        self.record_failures()
        return Prepared(windows, reference, calibration)

    def fail_calibrating_formats(self, record: dict) -> None:
        """No calibration set: every format that calibrates fails with its line; the others go on."""
        for choice in self.plan.choices:
            if choice.backend.calibrates(choice.format):
                line = f"{choice.key}: not made: {record['line']}"
                self.failures[choice.key] = {**record, "key": choice.key, "stage": "calibration", "line": line}
                self.ui.log(f"[red]✗[/red] {line}")

    def prepared_earlier(self) -> Prepared:
        """A release unit's view of its model's prepare unit: the files its finished stages recorded."""
        keys = [TOKENS, REFERENCE] + ([CALIBRATION] if self.plan.needs_calibration else [])
        missing = [key for key in keys if not self.manifest.stage(key)]
        if missing:
            raise QuantforgeError(f"{self.run_dir}: the prepare unit has not finished ({', '.join(missing)} missing)")
        path = {key: self.run_dir / next(iter(self.manifest.stage(key)["outputs"])) for key in keys}
        return Prepared(np.load(path[TOKENS]), path[REFERENCE], path.get(CALIBRATION))

    def make(self, choice: Choice, prepared: Prepared) -> Made:
        self.refuse_unsupported(choice)
        with self.contained(choice, "quantize"):
            self.intermediates(choice, prepared.calibration)
            return self.quantize(choice, self.parameters, prepared.calibration, self.search_settings(choice, prepared))

    def made_earlier(self, choice: Choice) -> Made:
        """A release unit's view of the quantize unit of ``choice``: what its finished stage recorded."""
        key = quantize_stage(choice.key)
        record = self.manifest.stage(key)
        if not record:
            raise QuantforgeError(f"{self.run_dir}: {choice.key} has not been quantized ({key} missing)")
        return Made(self.run_dir / next(iter(record["outputs"])), record["result"]["tensor_bytes"], key)

    def measure(self, choice: Choice, prepared: Prepared, made: Made) -> None:
        self.refuse_unsupported(choice)
        with self.contained(choice, "evaluate"):
            self.evaluate(choice, made, prepared.windows, prepared.reference)
            for kv_cache in kv_caches(self.plan, choice):
                self.evaluate(choice, made, prepared.windows, prepared.reference, kv_cache)
            if self.plan.speed:
                self.speed(
                    choice.key,
                    choice.backend.probe_target(made.folder),
                    made.tensor_bytes,
                    prepared.windows[0],
                    made.stage,
                    backend=choice.backend.name if has_own_probe(choice.backend) else None,
                )

    def card(self) -> dict:
        """The card from the manifest; a library failing here loses no measurement (exit 3: they are all in
        run.json, and ``quantforge card`` writes the card from them again)."""
        try:
            with self.shared_stage("card", "quantforge", fatal=False, swallow=False):
                return write_card(self.run_dir, self.plan.targets)
        except StageFailed as failure:
            advice = f"; every measurement is kept in run.json: 'quantforge card {self.run_dir}' writes the card again"
            raise StageFailed(str(failure) + advice, failure.record) from failure

    def refuse_unsupported(self, choice: Choice) -> None:
        if choice.key in self.failures and self.failures[choice.key].get("stage") in ("check", "calibration"):
            raise StageFailed(self.failures[choice.key]["line"], self.failures[choice.key])

    def record_failures(self) -> None:
        """The run's failed formats and shared stages, for the card; what later succeeds is no longer listed."""
        self.manifest.data["failures"] = self.failures
        self.manifest.data["stage_failures"] = self.stage_failures
        self.manifest.save()

    @contextlib.contextmanager
    def shared_stage(self, key: str, library: str, *, fatal: bool, swallow: bool = True):
        """A library raising in a stage that no single format owns becomes one line: the stage, the library and its
        version (where the exception left quantforge's code; ``library`` when it did not), its last line and the
        log that holds the traceback.

        ``fatal``: nothing can be measured without the stage (tokens, reference): the build stops, exit 2.
        Otherwise the failure is kept for the card (exit 3) and, when ``swallow``, the build goes on without it.
        Our own one-line errors, interrupts and full or read-only disks pass through as they are.
        """
        from .backends import library_version
        from .errors import EXIT_BAD_INPUT
        from .failures import describe_failure, is_environment_error, library_of, shown_path

        try:
            yield
        except QuantforgeError as exc:
            if fatal or isinstance(exc, StageFailed) or not exc.from_library:
                raise
            failed = exc
        except Exception as exc:
            if is_environment_error(exc):
                raise
            failed = exc
        else:
            self.stage_failures.pop(key, None)
            return
        exc = failed
        log = self.paths.log(key.rstrip("/").replace("/", "-"))
        name = library_of(exc, library_version(library))
        record = describe_failure(key, key.split("/")[0], name, exc, log, self.run_dir)
        record["line"] = f"{key.rstrip('/')} failed in {name}: {record['error']} (log: {shown_path(log)})"
        if fatal:
            raise StageFailed(record["line"] + "; nothing was quantized", record, EXIT_BAD_INPUT) from exc
        self.stage_failures[key] = record
        self.ui.log(f"[red]✗[/red] {record['line']}")
        if not swallow:
            raise StageFailed(record["line"], record) from exc

    # -- session: checks before any work, in the order session runs them -----------------------------------------------

    def precheck_hub_download(self) -> None:
        """Before downloading a Hub model: refuse, with the numbers, one this host cannot build, when its size can
        be had without the weights (a recipe's size: block, or the Hub's safetensors metadata)."""
        from .resources import check_plan
        from .source import model_size_without_weights

        if self.plan.spec.kind != "hub":
            return
        try:
            facts = model_size_without_weights(self.plan.spec, self.plan.recipe)
        except QuantforgeError:
            return  # no size before the download: the check after it still runs before any work
        check_plan(resource_plan(self.plan, facts, self.host_speed()), self.run_dir, done=set(self.manifest.stages))

    def fetch(self) -> SourceModel:
        """Make the model available and describe it; nothing is recorded until the checks have passed."""
        spec = self.plan.spec
        with self.ui.task(f"fetch {spec.target}") as advance:
            return fetch(
                spec,
                allow_pickle=self.plan.settings["allow_pickle"],
                trust_remote_code=self.plan.settings["trust_remote_code"],
                log=self.ui.log,
                progress=advance,
            )

    def check_config_readable(self) -> None:
        """transformers must understand the model's config (the reference runs in it): say so now, in one line."""
        from transformers import AutoConfig

        from .backends import library_version

        try:
            AutoConfig.from_pretrained(self.source.path, trust_remote_code=self.plan.settings["trust_remote_code"])
        except Exception as exc:  # noqa: BLE001 - transformers raises ValueError, KeyError, OSError ... here
            # Its first sentence names the problem (an unknown model type, say); the rest is upgrade advice.
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0].split(". ")[0][:300]
            raise QuantforgeError(
                f"{library_version('transformers')} cannot read {self.source.path / 'config.json'}: {first}"
            ) from None

    def check_backends(self) -> None:
        problems = []
        for choice in self.plan.choices:
            problems += [
                f"{choice.key}: {p}" for p in choice.backend.check(self.source, choice.format, self.plan.quantize)
            ]
        if problems:
            raise QuantforgeError(
                problems[0] + (f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else "")
            )

    def check_same_model(self) -> None:
        """Refuse to mix two models' stages in one run directory."""
        previous = (self.manifest.data.get("plan") or {}).get("model")
        current = self.plan.to_json()["model"]
        if previous and previous["target"] != current["target"] and not self.plan.request.force:
            raise QuantforgeError(
                f"{self.run_dir} holds a run of {previous['target']}, not {current['target']}; "
                "choose another --out, or pass --force to replace it"
            )

    def unsupported_formats(self) -> dict[str, dict]:
        """Formats whose library cannot handle this model, found up front: each fails alone, the rest go on."""
        from .failures import unsupported_record

        failures = {}
        for choice in self.plan.choices:
            reason = choice.backend.unsupported(self.source, choice.format)
            if reason:
                failures[choice.key] = unsupported_record(choice.key, choice.backend.library(), reason)
        if failures and len(failures) == len(self.plan.choices):
            # Nothing asked for can be made: refuse before any work, as for any other bad input.
            raise QuantforgeError(next(iter(failures.values()))["line"])
        for failure in failures.values():
            self.ui.log(f"[red]✗[/red] {failure['line']}")
        return failures

    def plan_resources(self) -> None:
        """Predict every stage's memory, disk and time on this host; refuse now, with the numbers, what cannot fit;
        keep the prediction in the manifest beside each stage's measured peak and seconds."""
        from .resources import check_plan

        facts = {**self.source.config, "parameters": self.parameters}
        self.resource_plan = resource_plan(self.plan, facts, self.host_speed())
        done = set(self.manifest.stages)
        check_plan(self.resource_plan, self.run_dir, done=done)
        self.ui.log(plan_line(self.resource_plan, done))

    def host_speed(self):
        from .resources import measure_host

        if self._host_speed is None:
            self._host_speed = measure_host(self.plan.threads, self.plan.device, runs_llamacpp(self.plan))
        return self._host_speed

    def record_fetch(self) -> None:
        # Fetching is re-checked on every build (cheap: cached downloads, remembered hashes), so a changed local
        # folder or a moved Hub revision reaches every downstream stage through this stage's output digest.
        source_json = self.paths.source

        def produce():
            atomic_write_json(source_json, self.source.to_json())
            return self.source.to_json()

        self.manifest.stages.pop(FETCH, None)
        self.stage(
            FETCH, None, inputs={"spec": self.plan.spec.__dict__}, settings={}, outputs=[source_json], produce=produce
        )

    # -- prepare: what every format shares -----------------------------------------------------------------------------

    def tokens(self) -> np.ndarray:
        from .evaluate import bos_token_id, cuts_like_llama_perplexity, text_tokens_needed, tokenize_text
        from .textdata import load_text

        settings = self.plan.eval
        text = load_text(settings.text)
        if settings.scoring == "second-half":
            text = text.as_file()  # llama-perplexity reads the data set's standard file (wiki.test.raw)
        path = self.paths.eval_windows

        bos = bos_token_id(self.source.path)

        def produce():
            needed = text_tokens_needed(settings.context, settings.windows, bos, settings.scoring)
            with self.ui.task(f"tokenize {text.name}"):
                ids = tokenize_text(self.source.path, text.joined, needed=needed)
                windows = make_windows(ids, settings.context, settings.windows, bos, settings.scoring)
            with atomic_output(path) as tmp, open(tmp, "wb") as handle:
                np.save(handle, windows)
            return {
                "text": text.describe(),
                "windows": int(windows.shape[0]),
                "context": int(windows.shape[1]),
                "bos_token_id": bos,
            }

        self.stage(
            TOKENS,
            "tokenize evaluation text",
            inputs={"source": self.digest(FETCH), "text": text.sha256},
            # BOS is a setting of the windows: stored references made without it are never reused with it. So is
            # llama-perplexity's cut (windows made before it are made again).
            settings={
                **settings.to_json(),
                "bos_token_id": bos,
                **({"cut": "llama-perplexity"} if cuts_like_llama_perplexity(bos, settings.scoring) else {}),
            },
            outputs=[path],
            produce=produce,
        )
        return np.load(path)

    def reference(self, windows: np.ndarray, runner: "LazyRunner") -> Path:
        path = self.paths.reference
        inputs = {"source": self.digest(FETCH), "tokens": self.digest(TOKENS)}

        def produce():
            first = self.plan.eval.first_scored
            with self.ui.task("evaluate reference (transformers, float32)", total=len(windows)) as advance:
                try:
                    refs, summary = score_reference(
                        partial(scored_logit_blocks, runner.get(), first=first),
                        windows,
                        advance,
                        progress_path=self.progress_path(REFERENCE, inputs),
                        first=first,
                    )
                except NonFiniteLogits as exc:
                    raise self.non_finite_reference(exc) from None
            save_reference(path, refs)
            return {**summary, "runtime": "transformers", "dtype": "float32", "threads": self.plan.threads}

        self.stage(
            REFERENCE,
            "evaluate reference",
            inputs=inputs,
            settings={"reference_format": REFERENCE_FORMAT},
            outputs=[path],
            produce=produce,
        )
        return path

    def non_finite_reference(self, exc: NonFiniteLogits) -> QuantforgeError:
        """The model itself scores NaN or infinity: nothing can be compared with it, so the build stops before any
        format is made, naming the stored tensors to blame (found by a scan made only now)."""
        from .source import describe_non_finite, non_finite_weights

        found = non_finite_weights(self.source.path)
        if found:
            cause = f"the checkpoint stores non-finite weights: {describe_non_finite(found)}"
            advice = "repair or re-download the checkpoint"
        else:
            cause = (
                "every stored weight is finite, so the float32 forward overflows or the model gives the next token "
                "no probability at all"
            )
            advice = "check the model in transformers on this text"
        return QuantforgeError(f"{exc}; {cause}; {advice} (nothing was quantized)")

    def tasks(self, key: str, runner: "LazyRunner", upstream: str) -> None:
        """One stage per task, so an interrupted evaluation resumes at the task where it stopped."""
        from .tasks import run_task

        settings = self.plan.tasks
        for name in settings["names"]:
            path = self.paths.tasks(key, name)

            def produce(name=name, path=path):
                with self.ui.task(f"task {name} on {key} (requests)") as advance:
                    result = run_task(
                        runner.get(),
                        self.source.path,
                        name,
                        settings["data"],
                        settings["limit"],
                        self.paths.work,
                        max_length=runner.context,
                        log_path=self.paths.log(f"tasks-{key}-{name}"),
                        on_request=advance,
                    )
                result["runtime"] = runner.get().runtime
                atomic_write_json(path, result)
                return result

            data_file = settings["data_files"][name]
            self.stage(
                tasks_stage(key, name),
                f"task {name} on {key}",
                inputs={"model": self.digest(upstream), "data": data_file},
                settings={"limit": settings["limit"]},
                outputs=[path],
                produce=produce,
            )

    def speed(
        self, key: str, target, weight_bytes: int, prompt: np.ndarray, upstream: str, backend: str | None = None
    ) -> None:
        """Decode-speed probe in the format's own runtime (a separate process: quantforge's probe for the runtime,
        or ``backend``'s own when it brings one), set beside the roofline."""
        import subprocess
        import sys

        from .gpus import device_roofline, gpu_rooflines, roofline
        from .openmp import users_environment, wait_policy

        settings = dict(self.plan.speed)
        probe_env = users_environment()  # timed as its users run it, not with this process's short spin
        path = self.paths.speed(key)
        bandwidth = self.host()["bandwidth_gbs"]

        def produce():
            result = {
                "weight_bytes": weight_bytes,
                "host_bandwidth_gbs": bandwidth,
                "host_decode_tps_bound": roofline(weight_bytes, bandwidth),
                "gpus": gpu_rooflines(weight_bytes),
                "prompt_tokens": settings["prompt_tokens"],
                "gen_tokens": settings["gen_tokens"],
                "runs": settings["runs"],
                "threads": self.plan.threads,
            }
            if isinstance(target, str):
                result.update(measured=False, reason=target)
            elif target[0] == "vllm" and not self.plan.device.startswith("cuda"):
                # vLLM runs on a GPU: beside formats timed on this build's CPU its figures would not compare
                result.update(measured=False, reason="vLLM runs on a GPU and this build's --device is cpu")
            else:
                runtime, artifact = target
                prompt_path = self.paths.probe_prompt
                with atomic_output(prompt_path) as tmp, open(tmp, "wb") as handle:  # this run's prompt, always
                    np.save(handle, prompt[: settings["prompt_tokens"]])
                command = [
                    sys.executable,
                    "-m",
                    "quantforge.probe_process",
                    "--runtime",
                    runtime,
                    "--path",
                    str(artifact),
                    "--prompt",
                    str(prompt_path),
                    "--gen-tokens",
                    str(settings["gen_tokens"]),
                    "--runs",
                    str(settings["runs"]),
                    "--threads",
                    str(self.plan.threads),
                    "--device",
                    self.plan.device,
                    *(["--backend", backend] if backend else []),
                ]
                log = self.paths.log(f"speed-{key}")
                log.parent.mkdir(parents=True, exist_ok=True)
                with self.ui.task(f"speed {key} ({runtime})"), open(log, "ab") as stream:
                    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=stream, text=True, env=probe_env)
                if done.returncode != 0:
                    raise QuantforgeError(
                        f"the speed probe of {key} in {runtime} failed (exit {done.returncode}): {last_log_line(log)}",
                        from_library=True,
                    )
                measured = json.loads(done.stdout.strip().splitlines()[-1])
                if measured.get("peak_rss_mb"):  # the probe's own VmHWM (getrusage's is the largest child so far)
                    from .memory import note_child_peak

                    note_child_peak(int(measured["peak_rss_mb"] * (1 << 20)))
                result.update(measured=True, runtime=runtime, **measured)
                result.update(device_roofline(measured.get("device", "cpu"), weight_bytes, result))
            atomic_write_json(path, result)
            return result

        self.stage(
            speed_stage(key),
            f"speed {key}",
            inputs={
                "model": self.digest(upstream),
                "host": self.digest(HOST),
                "prompt": hashlib.sha256(
                    np.ascontiguousarray(prompt[: settings["prompt_tokens"]]).tobytes()
                ).hexdigest(),
            },
            settings={
                **settings,
                "threads": self.plan.threads,
                "omp_wait_policy": wait_policy(probe_env),
                "device": self.plan.device,
            },  # fmt: skip
            outputs=[path],
            produce=produce,
        )

    def host(self) -> dict:
        """This host's memory bandwidth, measured once per run, for the decode roofline."""
        import platform
        import subprocess
        import sys

        from .probe import bandwidth_buffer_bytes

        path = self.paths.host

        threads = self.plan.threads
        buffer_bytes = bandwidth_buffer_bytes()

        def produce():
            command = [sys.executable, "-m", "quantforge.probe_process", "--bandwidth", "--threads", str(threads)]
            with self.ui.task("measure memory bandwidth"):
                done = subprocess.run([*command, "--buffer-bytes", str(buffer_bytes)], capture_output=True, text=True)
                if done.returncode != 0:
                    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                    raise QuantforgeError(f"the memory-bandwidth probe failed (exit {done.returncode}): {last}")
                facts = {
                    "bandwidth_gbs": round(json.loads(done.stdout.splitlines()[-1])["bandwidth_gbs"], 2),
                    "method": f"numpy copy of {buffer_bytes >> 20} MB over {threads} thread(s), best of 5",
                    "cpus": os.cpu_count(),
                }
            atomic_write_json(path, facts)
            return facts

        # keyed by the machine: a run folder copied to another host measures that host
        machine = {"node": platform.node(), "machine": platform.machine(), "cpus": os.cpu_count()}
        settings = {"threads": threads, "buffer_bytes": buffer_bytes}
        if self._host is None:
            self._host = self.stage(HOST, None, inputs=machine, settings=settings, outputs=[path], produce=produce)
        return self._host.result

    def calibration(self) -> Path | None:
        """The run's one calibration set, tokenized once and shared by every format that calibrates."""
        if not self.plan.needs_calibration:
            return None
        from .calibration import load_calibration_text, sample_sequences, tokenize_documents

        settings = self.plan.calibration
        text = load_calibration_text(settings.dataset)
        path = self.paths.calibration

        def produce():
            with self.ui.task(f"calibration set ({text.name})"):
                sequences = sample_sequences(tokenize_documents(self.source.path, text.documents), settings)
            with atomic_output(path) as tmp, open(tmp, "wb") as handle:
                np.save(handle, sequences)
            return {"text": text.describe(), **settings.to_json()}

        self.stage(
            CALIBRATION,
            "tokenize calibration set",
            inputs={"source": self.digest(FETCH), "text": text.sha256},
            settings=settings.to_json(),
            outputs=[path],
            produce=produce,
        )
        return path

    # -- make: one format's artifact -----------------------------------------------------------------------------------

    def intermediates(self, choice: Choice, calibration: Path | None) -> None:
        """Files the format's backend shares between formats (the F16 GGUF, an importance matrix), each made once
        and recorded, before the format's own quantize stage (whose time and memory then are its own)."""
        for name, shared in choice.backend.intermediates(choice.format).items():
            if name in self._intermediates_made:
                continue
            self._intermediates_made.add(name)
            path = self.intermediate_path(name, shared.suffix)

            def produce(path=path, shared=shared, name=name):
                with self.ui.task(f"build {name}"), atomic_output(path) as tmp:
                    job = self.quantize_job(choice, tmp, calibration if shared.uses_calibration else None)
                    return shared.build(job) or {}

            inputs = {"source": self.digest(FETCH)}
            inputs.update({need: self.digest(intermediate_stage(need)) for need in shared.needs})
            if shared.uses_calibration:
                inputs["calibration"] = self.digest(CALIBRATION)
            self.stage(intermediate_stage(name), None, inputs=inputs, settings={}, outputs=[path], produce=produce)

    def intermediate_path(self, name: str, suffix: str) -> Path:
        return self.paths.intermediate(self.source.name, name, suffix)

    def search_settings(self, choice: Choice, prepared: Prepared) -> dict | None:
        """What a searching backend (gguf-auto) measures its candidates on: the run's evaluation windows and
        reference, and the targets it searches for. None for every other backend."""
        if not choice.backend.searches:
            return None
        from .fsutil import sha256_json

        targets = self.plan.targets
        # The candidates' measurements depend on the files and windows, not on the targets: kept in a folder named
        # by those inputs, they serve a later search for other targets too (it then makes only its confirmations).
        measured_on = {
            name: self.digest(key)
            for name, key in (("source", FETCH), ("calibration", CALIBRATION), ("reference", REFERENCE))
            if self.manifest.stage(key)
        }
        return {
            "folder": str(self.paths.work / "search" / f"{choice.key}-{sha256_json(measured_on)[:16]}"),
            "windows": str(self.paths.eval_windows),
            "reference": str(prepared.reference),
            "first": self.plan.eval.first_scored,
            "max_kld": targets.max_kld,
            "max_size": int(targets.max_size_gb * 1e9) if targets.max_size_gb is not None else None,
        }

    def quantize_job(
        self,
        choice: Choice,
        out: Path,
        calibration: Path | None,
        checkpoint_dir: Path | None = None,
        search: dict | None = None,
    ):
        return QuantizeJob(
            self.source,
            choice.format,
            {**self.plan.quantize, **({"search": search} if search else {})},
            out,
            self.recorded_intermediate,
            self.paths.logs,
            calibration=calibration,
            threads=self.plan.threads,
            device=self.plan.device,
            dtype=calibration_dtype(self.resource_plan, choice.key),
            log=self.ui.log,
            checkpoint_dir=checkpoint_dir,
        )

    def job_intermediates(self, choice: Choice) -> dict[str, Path]:
        """The shared files ``choice``'s quantizer may ask for (and those they were made from), as recorded."""
        shared = choice.backend.intermediates(choice.format)
        names = {*shared, *(need for made in shared.values() for need in made.needs)}
        return {
            name: self.recorded_intermediate(name) for name in names if self.manifest.stage(intermediate_stage(name))
        }

    def recorded_intermediate(self, name: str) -> Path:
        record = self.manifest.stage(intermediate_stage(name))
        if not record:
            raise QuantforgeError(f"intermediate {name} was not made before the quantize stage that needs it")
        return self.run_dir / next(iter(record["outputs"]))

    def quantize(self, choice: Choice, parameters: int, calibration: Path | None, search: dict | None = None) -> Made:
        from .artifacts import measure

        artifact_dir = self.paths.artifact(choice.key)
        log_dir = self.paths.logs
        checkpoint_dir = self.paths.checkpoint(choice.key)
        uses_calibration = choice.backend.calibrates(choice.format)

        def produce():
            log = log_dir / f"quantize-{choice.key}.log"
            with (
                self.ui.task(f"quantize {choice.key} ({choice.backend.name})") as advance,
                atomic_output(artifact_dir) as tmp,
            ):
                job = self.quantize_job(choice, tmp, calibration if uses_calibration else None, checkpoint_dir, search)
                with (
                    capture_output(log),
                    follow_progress(log, choice.backend.progress_pattern, lambda done, total: advance(done, total + 1)),
                ):
                    with interrupts_kept():
                        facts = quantize_in_child(job, choice.backend.name, self.job_intermediates(choice), log)
            remove_path(checkpoint_dir)  # only a finished artifact makes the layer checkpoints obsolete
            return {**facts, **measure(choice.backend.artifact_file(artifact_dir), parameters)}

        inputs = {"source": self.digest(FETCH)}
        if uses_calibration:
            inputs["calibration"] = self.digest(CALIBRATION)
        searched = {}
        if search:  # its candidates are scored against the reference, for these targets
            inputs.update(reference=self.digest(REFERENCE), tokens=self.digest(TOKENS))
            searched = {"search_targets": {k: search[k] for k in ("max_kld", "max_size")}}
        done = self.stage(
            quantize_stage(choice.key),
            f"quantize {choice.key}",
            inputs=inputs,
            settings={"format": choice.format.name, "backend": choice.backend.name, **self.plan.quantize, **searched},
            outputs=[artifact_dir],
            produce=produce,
        )
        return Made(artifact_dir, done.result["tensor_bytes"], quantize_stage(choice.key))

    # -- measure: one format's figures (with tasks and speed above) ----------------------------------------------------

    def evaluate(
        self, choice: Choice, made: Made, windows: np.ndarray, reference_path: Path, kv_cache: str | None = None
    ) -> None:
        """Score the artifact from disk on the windows (and its tasks); with ``kv_cache``, score it again with that
        quantized KV cache in its runtime (a stage of its own, no tasks)."""
        if kv_cache:
            path, stage, name = (
                self.paths.kv_cache_evaluation(choice.key, kv_cache),
                kv_cache_stage(choice.key, kv_cache),
                f"{choice.key} with a {kv_cache} KV cache",
            )
        else:
            path, stage, name = self.paths.evaluation(choice.key), evaluate_stage(choice.key), choice.key
        progress_name = f"{choice.key}-kv-{kv_cache}" if kv_cache else choice.key
        artifact_dir = made.folder
        context = max(int(windows.shape[1]), TASK_CONTEXT if self.plan.tasks["names"] and not kv_cache else 0)

        def open_runner():
            from .runner_process import ChildRunner

            log = self.paths.log(f"evaluate-{choice.key}" + (f"-kv-{kv_cache}" if kv_cache else ""))
            with capture_output(log):  # the child's output (the runtime's own lines) goes to the format's log
                return ChildRunner(
                    choice.backend.name,
                    artifact_dir,
                    context=context,
                    threads=self.plan.threads,
                    device=self.plan.device,
                    log_path=log,
                    kv_cache=kv_cache,
                )

        inputs = {
            "artifact": self.digest(made.stage),
            "reference": self.digest(REFERENCE),
            "tokens": self.digest(TOKENS),
        }
        with LazyRunner(open_runner, context) as runner:

            def produce():
                refs = load_reference(reference_path)
                with self.ui.task(f"evaluate {name} ({runner.get().runtime})", total=len(windows)) as advance:
                    loaded, first = runner.get(), self.plan.eval.first_scored
                    summary = score_artifact(
                        partial(scored_logit_blocks, loaded, first=first),  # each window is scored before the next
                        windows,
                        refs,
                        advance,
                        progress_path=self.progress_path(progress_name, inputs),
                        first=first,
                    )
                summary.update(
                    runtime=runner.get().runtime,
                    threads=self.plan.threads,
                    flash_attn=getattr(runner.get(), "flash_attn", None),
                )
                if kv_cache:
                    summary["kv_cache"] = kv_cache
                    summary["kv_bytes_per_value"] = choice.backend.kv_cache_types(choice.format)[kv_cache]
                atomic_write_json(path, summary)
                return summary

            settings = {"threads": self.plan.threads, **({"kv_cache": kv_cache} if kv_cache else {})}
            self.stage(stage, f"evaluate {name}", inputs=inputs, settings=settings, outputs=[path], produce=produce)
            if not kv_cache:
                self.tasks(choice.key, runner, made.stage)

    # -- stage plumbing ------------------------------------------------------------------------------------------------

    def stage(self, key: str, description: str, *, inputs: dict, settings: dict, outputs: list[Path], produce):
        force = self.plan.request.force
        result = run_stage(
            self.manifest, key, inputs=inputs, settings=settings, outputs=outputs, produce=produce, force=force
        )
        if result.skipped and description:
            self.ui.skipped(description)
        return result

    def digest(self, key: str) -> str:
        return self.manifest.output_digest(key)

    def progress_path(self, key: str, inputs: dict) -> Path:
        """Where an evaluation keeps per-window results; named by its inputs, so a stale one is never reused."""
        from .fsutil import sha256_json

        return self.paths.progress(key, sha256_json(inputs))

    @contextlib.contextmanager
    def contained(self, choice: Choice, stage: str):
        """A library that raises inside one format's stage fails that format, not the build: the exception becomes
        one line (format, library and version, its last line, the log to read) and its traceback goes to the log.

        Interrupts and full or read-only disks still stop the whole build: they are not the format's fault.
        """
        from .failures import describe_failure, is_environment_error

        log = self.paths.log(f"{stage}-{choice.key}")
        try:
            yield
        except StageFailed:
            raise
        except Exception as exc:
            if is_environment_error(exc):
                raise
            record = describe_failure(choice.key, stage, choice.backend.library(stage), exc, log, self.run_dir)
            raise StageFailed(record["line"], record) from exc

    def open_reference_runner(self):
        from .runners import TorchRunner

        return TorchRunner.from_folder(
            self.source.path,
            threads=self.plan.threads,
            device=self.plan.device,
            trust_remote_code=self.plan.settings["trust_remote_code"],
        )


def last_log_line(log: Path) -> str:
    """The last line a child process wrote to its log (its exception's, when it raised one)."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else "no output"


def kv_caches(plan: Plan, choice: Choice) -> list[str]:
    """The asked quantized KV-cache types (--kv-cache) that the runtime of ``choice`` offers."""
    offered = choice.backend.kv_cache_types(choice.format)
    return [kv for kv in plan.settings.get("kv_cache") or [] if kv in offered]


def runs_llamacpp(plan: Plan) -> bool:
    return any(c.format.family == "gguf" for c in plan.choices)


def calibration_dtype(planned: dict, key: str) -> str:
    """The arithmetic the resource plan chose for this format's calibration: its choice for the formats that follow
    it, bf16 for the rest."""
    chosen = planned["quantize_dtype"]
    return chosen["dtype"] if key in chosen["formats"] else "bfloat16"


def resource_plan(plan: Plan, facts: dict, host) -> dict:
    """The resource plan (see resources.py) of this build for a model of the given size facts on ``host``."""
    from .resources import ModelSize, PlanInputs, make_resource_plan

    inputs = PlanInputs(
        formats=[(c.key, c.backend.cost_model(c.format), c.format.nominal_bits) for c in plan.choices],
        context=plan.eval.context,
        windows=plan.eval.windows,
        first_scored=plan.eval.first_scored,
        calibration_tokens=plan.calibration.samples * plan.calibration.seqlen if plan.needs_calibration else 0,
        speed_tokens=(plan.speed["prompt_tokens"] + plan.speed["gen_tokens"]) * plan.speed["runs"] if plan.speed else 0,
        speed_runs=plan.speed["runs"] if plan.speed else 3,
        speed_gen_tokens=plan.speed["gen_tokens"] if plan.speed else 0,
        intermediates=frozenset(name for c in plan.choices for name in c.backend.intermediates(c.format)),
        calibration_seqlen=plan.calibration.seqlen if plan.needs_calibration else 0,
        kv_caches={c.key: kv_caches(plan, c) for c in plan.choices if kv_caches(plan, c)},
        tasks=list(plan.tasks["names"]),
        device=plan.device,
        quantize_dtype=plan.quantize["dtype"],
        # not under --layer-resume: parameters in GPTQModel's disk offload cannot be cast back to bf16 before saving
        follows_dtype=frozenset(
            c.key
            for c in plan.choices
            if c.format.name in c.backend.follows_quantize_dtype and not plan.quantize["layer_resume"]
        ),
    )
    return make_resource_plan(ModelSize.from_facts(facts), inputs, host)


def plan_line(planned: dict, done: set[str]) -> str:
    """What the build has before it, said before it starts: the stages left, their predicted time and the peak."""
    # the card is written again by every build, so it is never "left"
    left = [stage for stage in planned["stages"] if stage["key"] not in done and stage["key"] != "card"]
    if not left:
        return "plan: every stage is done; the card is written again"
    seconds = sum(stage["seconds"] for stage in left)
    peak = max(left, key=lambda stage: stage["peak_rss_bytes"])
    minutes = f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"
    return (
        f"plan: {len(left)} stages left, about {minutes} on this host, peak memory {peak['peak_rss_bytes'] / 1e9:.1f}"
        f" GB ({peak['key']}); --plan-only lists each"
    )


def resource_plan_only(request: BuildRequest) -> dict:
    """``build --plan-only``: the resource plan without fetching weights (size from the recipe, the local folder,
    or the Hub's metadata), checked against this host."""
    from .resources import check_plan, measure_host
    from .source import model_size_without_weights

    plan = make_plan(request)
    facts = model_size_without_weights(plan.spec, plan.recipe)
    planned = resource_plan(plan, facts, measure_host(plan.threads, plan.device, runs_llamacpp(plan)))
    planned["model"]["name"] = plan.spec.name
    try:
        check_plan(planned, plan.run_dir)
        planned["fits"], planned["refusal"] = True, None
    except QuantforgeError as exc:
        planned["fits"], planned["refusal"] = False, str(exc)
    return planned


def build(request: BuildRequest, ui: UI | None = None) -> dict:
    plan = make_plan(request)
    return Build(plan, ui or UI()).run()

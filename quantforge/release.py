"""``quantforge release``: many models x formats as one release, run by a local or a Ray executor.

The release file (YAML, validated like recipes: file, line and key in every error) names the models, the shared
defaults and per-model overrides, and where results go. Each model gets a run directory under ``out``; the run's
manifest stays the one source of truth, so a unit that finished is never scheduled again, whichever executor ran
it, across restarts of the driver or of the cluster.

Units and their order: ``prepare`` (fetch, evaluation tokens, reference, calibration) of a model; then per format
``quantize`` and ``evaluate``; then the model's ``card`` once all its evaluations are in. Units of one model take
turns on its run directory (they wait for its lock), so an executor may start them as soon as their dependencies
are done.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml

from .errors import QuantforgeError, one_line
from .recipes import TARGETS_SCHEMA, _check, read_yaml_text
from .rundir import (
    CALIBRATION,
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
from .settings import file_schema, from_file

MODEL_SETTINGS = {
    **file_schema(),  # the build settings (settings.SETTINGS), as in recipes
    "targets": TARGETS_SCHEMA,
    # upload the model's finished artifacts after its card (see publish.py): to: ORG/NAME, private, gguf_repos, ...
    "push": {"to": str, "private": bool, "gguf_repos": str, "split_size": str},
}
RELEASE_SCHEMA = {
    "name": str,
    "description": str,
    "out": str,
    "defaults": MODEL_SETTINGS,
}
MODEL_SCHEMA = {"model": str, "name": str, **MODEL_SETTINGS}


@dataclass
class ReleaseModel:
    name: str
    model: str
    settings: dict  # defaults merged with the model's overrides


@dataclass
class Release:
    name: str
    path: Path
    out: Path
    models: list[ReleaseModel]


def _merge(defaults: dict, overrides: dict) -> dict:
    merged = dict(defaults)
    for key, value in overrides.items():
        merged[key] = {**defaults.get(key, {}), **value} if isinstance(value, dict) else value
    return merged


def load_release(path: Path) -> Release:
    text = read_yaml_text(path, "release file")
    try:
        node = yaml.compose(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise QuantforgeError(f"{path}{f':{mark.line + 1}' if mark else ''}: malformed YAML") from None
    if not isinstance(node, yaml.MappingNode):
        raise QuantforgeError(f"{path}: a release file is a mapping with 'models' and optional 'defaults' and 'out'")
    models_node = next((value for key, value in node.value if key.value == "models"), None)
    rest = yaml.MappingNode(node.tag, [(k, v) for k, v in node.value if k.value != "models"])
    top = _check(rest, RELEASE_SCHEMA, path, "")
    if not isinstance(models_node, yaml.SequenceNode) or not models_node.value:
        raise QuantforgeError(f"{path}: 'models' must be a non-empty list of models")
    defaults = top.get("defaults", {})
    models, names = [], set()
    for index, item in enumerate(models_node.value):
        entry = _check(item, MODEL_SCHEMA, path, f"models[{index}]")
        if "model" not in entry:
            raise QuantforgeError(f"{path}:{item.start_mark.line + 1}: models[{index}] has no 'model' key")
        name = entry.get("name") or Path(entry["model"]).name.replace("/", "-")
        if name in names:
            raise QuantforgeError(f"{path}:{item.start_mark.line + 1}: two models are named '{name}'; set 'name'")
        names.add(name)
        settings = _merge(defaults, {k: v for k, v in entry.items() if k not in ("model", "name")})
        model = entry["model"]
        if not model.startswith("bundled:") and (path.parent / model).exists():
            model = str((path.parent / model).resolve())  # folders are relative to the release file
        models.append(ReleaseModel(name, model, settings))
    out = Path(top.get("out", f"runs/{top.get('name', path.stem)}"))
    out = out if out.is_absolute() else (path.parent / out).resolve()
    return Release(top.get("name", path.stem), path, out, models)


def build_request(release: Release, model: ReleaseModel):
    """The `quantforge build` request that a release makes for one model."""
    from .pipeline import BuildRequest

    return BuildRequest(
        model=model.model,
        out=release.out / model.name,
        targets=model.settings.get("targets", {}),
        settings=from_file(model.settings),
        command=f"quantforge release {shlex.quote(str(release.path))}",
    )


def retry_command(request, key: str | None) -> str:
    """The `quantforge build` command that redoes just this model (or this format of it)."""
    parts = ["quantforge", "build", request.model, "--out", str(request.out)]
    if request.revision:
        parts += ["--revision", request.revision]
    formats = [key.split("@")[0]] if key else request.formats
    if formats:
        parts += ["--formats", ",".join(formats)]
    if key and "@" in key:
        parts += ["--backend", key.split("@")[1]]
    return " ".join(shlex.quote(p) for p in parts)


# ----------------------------------------------------------------------------------------------- the plan


@dataclass
class Unit:
    id: str  # "<model>/prepare", "<model>/quantize/<key>", "<model>/evaluate/<key>", "<model>/card"
    model: str
    kind: str
    key: str | None
    depends: list[str] = field(default_factory=list)
    resources: dict = field(default_factory=dict)  # cpus, gpus, memory_bytes (estimated)
    done: bool = False


UNIT_STAGES = {  # the stages a unit runs, as prefixes of their manifest keys ({key}: the unit's format)
    "prepare": (TOKENS, REFERENCE, tasks_stage(REFERENCE), speed_stage(REFERENCE), HOST, CALIBRATION),
    "quantize": (intermediate_stage(""), quantize_stage("{key}")),
    "evaluate": (evaluate_stage("{key}"), kv_cache_stage("{key}"), tasks_stage("{key}"), speed_stage("{key}")),
    "card": ("card",),
    "push": (),
}


def _unit_memory(resource_plan: dict | None, kind: str, key: str | None) -> int | None:
    """Peak bytes a unit may need: the largest predicted peak of its stages (None without a plan)."""
    if not resource_plan:
        return None
    prefixes = tuple(prefix.format(key=key) for prefix in UNIT_STAGES[kind])
    peaks = [s["peak_rss_bytes"] for s in resource_plan["stages"] if s["key"].startswith(prefixes)]
    return max(peaks) if peaks else None


def _resource_plan(plan) -> dict | None:
    """The model's resource plan when its size is known without downloading it (see resources.py)."""
    from .pipeline import resource_plan
    from .resources import HostSpeed
    from .source import model_size_without_weights

    try:
        facts = model_size_without_weights(plan.spec, plan.recipe)
    except QuantforgeError:
        return None
    return resource_plan(plan, facts, HostSpeed(gemm_gflops=1.0, memory_available=None, threads=plan.threads))


def plan_release(release: Release) -> tuple[list[Unit], dict]:
    """Every unit with its dependencies, resources and whether the run's manifest already holds its work."""
    from .manifest import Manifest
    from .pipeline import kv_caches, make_plan

    units, plans = [], {}
    for model in release.models:
        plan = make_plan(build_request(release, model))
        plans[model.name] = plan
        resource_plan = _resource_plan(plan)
        stages = Manifest.open(plan.run_dir).stages if RunDir(plan.run_dir).manifest.exists() else {}
        gpus = 1 if plan.device.startswith("cuda") else 0  # --device cuda: each unit holds one GPU

        def unit(kind, key=None, depends=(), done=False, model=model, gpus=gpus, resource_plan=resource_plan):
            memory = _unit_memory(resource_plan, kind, key)
            resources = {"cpus": 1, "gpus": gpus, **({"memory_bytes": memory} if memory else {})}
            return Unit(
                f"{model.name}/{kind}" + (f"/{key}" if key else ""),
                model.name,
                kind,
                key,
                list(depends),
                resources,
                done,
            )

        prepare = unit("prepare", done=REFERENCE in stages and (not plan.needs_calibration or CALIBRATION in stages))
        units.append(prepare)
        evaluations = []
        for choice in plan.choices:
            quantize = unit("quantize", choice.key, [prepare.id], quantize_stage(choice.key) in stages)
            evaluate = unit(
                "evaluate",
                choice.key,
                [quantize.id],
                evaluate_stage(choice.key) in stages
                and all(kv_cache_stage(choice.key, kv) in stages for kv in kv_caches(plan, choice))
                and (not plan.speed or speed_stage(choice.key) in stages),
            )
            units += [quantize, evaluate]
            evaluations.append(evaluate.id)
        card, manifest = RunDir(plan.run_dir).card, RunDir(plan.run_dir).manifest
        card_current = card.exists() and card.stat().st_mtime >= manifest.stat().st_mtime
        card_unit = unit(
            "card", None, evaluations, card_current and all(u.done for u in units if u.model == model.name)
        )
        units.append(card_unit)
        if model.settings.get("push"):
            units.append(unit("push", None, [card_unit.id]))  # push.json makes a repeated push skip what is there
    return units, plans


def check_pushes(release: Release) -> None:
    """Before any unit runs: every push target is a valid repo name, its settings parse, and a token is there."""
    from .publish import GGUF_LAYOUTS, check_repo_name, check_token, parse_size

    pushes = [m.settings["push"] for m in release.models if m.settings.get("push")]
    for push in pushes:
        if "to" not in push:
            raise QuantforgeError(f"{release.path}: a 'push' setting needs 'to: ORG/NAME'")
        check_repo_name(push["to"])
        if push.get("split_size"):
            parse_size(push["split_size"])
        if push.get("gguf_repos", "one") not in GGUF_LAYOUTS:
            raise QuantforgeError(f"{release.path}: push.gguf_repos must be one of {', '.join(GGUF_LAYOUTS)}")
    if pushes:
        check_token()


def run_unit(release_path: str, model_name: str, kind: str, key: str | None) -> dict:
    """Run one unit (in this process, or in a Ray worker). Imports nothing heavy until the unit needs it."""
    from .openmp import wait_briefly
    from .pipeline import Build, make_plan
    from .ui import UI

    release = load_release(Path(release_path))
    model = next(m for m in release.models if m.name == model_name)
    plan = make_plan(build_request(release, model))
    wait_briefly()
    if kind == "push":
        from .publish import parse_size, push_run

        push = model.settings["push"]
        pushed = push_run(
            plan.run_dir,
            push["to"],
            private=push.get("private", False),
            gguf_layout=push.get("gguf_repos", "one"),
            split_bytes=parse_size(push["split_size"]) if push.get("split_size") else None,
            log=lambda line: None,
        )
        return {"unit": kind, "key": None, "repos": sorted(pushed)}
    card = Build(plan, UI(quiet=True)).run_unit(kind, key)
    return {"unit": kind, "key": key, "recommended": card.get("decision", {}).get("recommended")}


# ----------------------------------------------------------------------------------------------- executors


@dataclass
class Outcome:
    unit: Unit
    status: str  # "done", "skipped (done earlier)", "failed", "not run: <dependency> failed"
    reason: str = ""


class LocalExecutor:
    """Runs the units in order in this process."""

    name = "local"

    def run(self, release: Release, units: list[Unit], report: Callable[[Outcome], None]) -> list[Outcome]:
        outcomes: dict[str, Outcome] = {}
        for unit in units:
            failed = [d for d in unit.depends if outcomes[d].status not in ("done", "skipped (done earlier)")]
            if failed:
                outcome = Outcome(unit, f"not run: {failed[0]} failed")
            elif unit.done:
                outcome = Outcome(unit, "skipped (done earlier)")
            else:
                try:
                    run_unit(str(release.path), unit.model, unit.kind, unit.key)
                    outcome = Outcome(unit, "done")
                except QuantforgeError as exc:
                    outcome = Outcome(unit, "failed", str(exc))
                except Exception as exc:  # noqa: BLE001 - one model's crash must not stop the others
                    outcome = Outcome(unit, "failed", one_line(exc))
            outcomes[unit.id] = outcome
            report(outcome)
        return list(outcomes.values())


class RayExecutor:
    """Submits the units to a Ray cluster as tasks that declare resources, depend on each other's results and are
    retried when a worker dies."""

    name = "ray"

    def __init__(self, address: str | None = None, max_retries: int = 3):
        self.address = address
        self.max_retries = max_retries

    def _connect(self):
        if not self.address:
            # A local cluster for this release only: keep every Ray process on loopback (by default Ray binds to
            # the machine's network address and all interfaces).
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        import ray

        if not ray.is_initialized():
            if self.address:
                ray.init(address=self.address, log_to_driver=False)
            else:
                ray.init(
                    num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1"
                )
        return ray

    def run(self, release: Release, units: list[Unit], report: Callable[[Outcome], None]) -> list[Outcome]:
        ray = self._connect()

        @ray.remote(max_retries=self.max_retries, retry_exceptions=False)
        def remote_unit(release_path, model, kind, key, *dependencies):
            return run_unit(release_path, model, kind, key)

        refs, by_ref, outcomes = {}, {}, {}
        for unit in units:
            if unit.done:
                outcomes[unit.id] = Outcome(unit, "skipped (done earlier)")
                report(outcomes[unit.id])
                continue
            dependencies = [refs[d] for d in unit.depends if d in refs]
            options = {"num_cpus": unit.resources["cpus"], "num_gpus": unit.resources["gpus"]}
            if unit.resources.get("memory_bytes"):
                options["memory"] = unit.resources["memory_bytes"]
            ref = remote_unit.options(**options).remote(
                str(release.path), unit.model, unit.kind, unit.key, *dependencies
            )
            refs[unit.id] = ref
            by_ref[ref] = unit
        pending = list(by_ref)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            unit = by_ref[ready[0]]
            failed = [
                d
                for d in unit.depends
                if outcomes.get(d) and outcomes[d].status not in ("done", "skipped (done earlier)")
            ]
            try:
                ray.get(ready[0])
                outcome = Outcome(unit, "done")
            except ray.exceptions.RayTaskError as exc:
                cause = getattr(exc, "cause", None) or exc
                reason = str(cause) if isinstance(cause, QuantforgeError) else one_line(cause)
                outcome = Outcome(unit, f"not run: {failed[0]} failed") if failed else Outcome(unit, "failed", reason)
            except ray.exceptions.RayError as exc:  # the worker died more often than the task may be retried
                outcome = Outcome(unit, "failed", one_line(exc))
            outcomes[unit.id] = outcome
            report(outcome)
        return [outcomes[u.id] for u in units]


EXECUTORS = {"local": LocalExecutor, "ray": RayExecutor}


def describe_failure(release: Release, outcome: Outcome) -> str:
    model = next(m for m in release.models if m.name == outcome.unit.model)
    return (
        f"{outcome.unit.id}: {outcome.reason} (retry: {retry_command(build_request(release, model), outcome.unit.key)})"
    )

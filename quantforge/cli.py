"""The ``quantforge`` command. Heavy libraries are imported inside the commands that need them, never here."""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
from pathlib import Path

import click

from . import __version__
from .errors import (
    DISK_ADVICE,
    DISK_ERRORS,
    EXIT_FORMATS_FAILED,
    EXIT_INTERRUPTED,
    EXIT_NO_RECOMMENDATION,
    QuantforgeError,
)
from .openmp import wait_briefly
from .rundir import CARD_MARKDOWN, MANIFEST_NAME, RunDir
from .settings import click_options


def _pin_the_hugging_face_cache() -> None:
    """Name huggingface_hub's default cache in HF_HOME when it is unset.

    GPTQModel imports tokenicer, which sets HF_HOME to /tmp/tokenicer_hf_home when it is unset: every download
    after it in the process, and in every child process, would go to that folder instead of the user's cache (and
    be lost on reboot). With HF_HOME set to the folder huggingface_hub uses anyway, nothing moves.
    """
    if "HF_HOME" not in os.environ:
        cache = os.environ.get("XDG_CACHE_HOME", os.path.join("~", ".cache"))
        os.environ["HF_HOME"] = os.path.expanduser(os.path.join(cache, "huggingface"))


def _quiet_libraries() -> None:
    """Keep library chatter (per-tensor logs, advice banners) out of the user's terminal."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    wait_briefly()
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TORCH_LOGS", "-all")  # torch's own log handler: errors only
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # ours are rich bars; theirs would interleave
    for name in ("torch", "torchao", "transformers", "datasets", "huggingface_hub", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _task_recovery(value: str | None) -> dict[str, float] | None:
    if not value:
        return None
    limits = {}
    for item in value.split(","):
        name, sep, number = item.partition("=")
        try:
            limits[name.strip()] = float(number)
        except ValueError:
            raise QuantforgeError(f"--min-task-recovery takes TASK=PCT pairs, like arc_easy=97; not {item!r}") from None
        if not sep:
            raise QuantforgeError(f"--min-task-recovery takes TASK=PCT pairs, like arc_easy=97; not {item!r}")
    return limits


TARGET_OPTIONS = [
    click.option("--max-ppl-increase", type=float, help="Target: largest perplexity increase in percent (default 5)."),
    click.option(
        "--max-kld", type=float, help="Target: largest mean KL divergence against the reference (default 0.1)."
    ),
    click.option("--min-top1-agreement", type=float, help="Target: smallest top-1 token agreement (0-1)."),
    click.option("--min-recovery", type=float, help="Target: smallest mean task accuracy recovery, in percent."),
    click.option("--min-task-recovery", help="Target per task, e.g. arc_easy=98,hellaswag=97 (percent)."),
    click.option("--max-size", "max_size_gb", type=float, help="Target: largest artifact size in GB."),
    click.option("--min-decode-tps", type=float, help="Target: smallest decode speed measured on this host (tok/s)."),
    click.option(
        "--gpu",
        help="Target: must fit and run on this GPU (B200, H200, H100, H100 PCIe, A100, L40S, RTX 5090, RTX 4090, "
        "RTX 3090, A10G, L4, T4, or a size such as 20GB).",
    ),
    click.option("--context", type=int, help="Tokens per sequence the GPU must hold (default 4096)."),
    click.option("--concurrency", type=int, help="Sequences held at once on the GPU (default 1)."),
    click.option("--runtime", help="Count only formats that run in: any, vllm, transformers, llama.cpp, ollama."),
]


# Not a target: what the exit status says of the verdict, for release pipelines that gate on it.
REQUIRE_RECOMMENDATION = click.option(
    "--require-recommendation",
    is_flag=True,
    help="Exit 4 when no format meets the targets (after 3 for failed formats), so a pipeline can gate on it.",
)


def target_options(function):
    for option in reversed(TARGET_OPTIONS):
        function = option(function)
    return REQUIRE_RECOMMENDATION(function)


def target_overrides(**values) -> dict:
    values["min_task_recovery"] = _task_recovery(values.get("min_task_recovery"))
    return {key: value for key, value in values.items() if value is not None}


PUSH_OPTIONS = [
    click.option("--private", is_flag=True, help="Create the Hub repos as private."),
    click.option(
        "--gguf-repos",
        type=click.Choice(["one", "per-format"]),
        default="one",
        show_default=True,
        help="GGUF files in one ORG/NAME-GGUF repo, or a repo per format.",
    ),
    click.option("--split-size", help="Split GGUF files larger than this (e.g. 40GB) in llama.cpp's split format."),
]


def push_options(function):
    for option in reversed(PUSH_OPTIONS):
        function = option(function)
    return function


def _check_push(repo: str | None, split_size: str | None) -> int | None:
    """Refuse a bad repo name, a missing token or a bad size before any work; returns the split size in bytes."""
    from .publish import check_repo_name, check_token, parse_size

    split_bytes = parse_size(split_size) if split_size else None
    if repo:
        check_repo_name(repo)
        check_token()
    return split_bytes


def _push(run_dir: Path, repo: str, private: bool, gguf_repos: str, split_bytes: int | None, as_json: bool) -> dict:
    from .publish import push_run

    report = push_run(
        run_dir,
        repo,
        private=private,
        gguf_layout=gguf_repos,
        split_bytes=split_bytes,
        log=lambda line: click.echo(line, err=True),
    )
    if not as_json:
        for pushed in report.values():
            state = "unchanged" if pushed["skipped"] else f"commit {pushed['commit'][:12]}"
            click.echo(f"pushed: {pushed['url']} ({', '.join(pushed['formats'])}; {state})")
    return report


class QuantforgeGroup(click.Group):
    """Turns QuantforgeError into one line on stderr and exit code 2."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except QuantforgeError as exc:
            click.echo(f"error: {exc}", err=True)
            ctx.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted: finished stages are kept; run the same command again to resume", err=True)
            ctx.exit(EXIT_INTERRUPTED)
        except OSError as exc:
            if exc.errno not in DISK_ERRORS:
                raise
            where = f" writing {exc.filename}" if exc.filename else ""
            click.echo(
                f"error: {DISK_ERRORS[exc.errno]}{where}; {DISK_ADVICE[exc.errno]} "
                "(finished stages are kept; the same command resumes)",
                err=True,
            )
            ctx.exit(2)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as exc:  # noqa: BLE001 - the last line of defence: a bug of ours is one line too
            log = _write_crash_log(exc)
            click.echo(
                f"error: quantforge {__version__} stopped on an unexpected {type(exc).__name__}: "
                f"{(str(exc).strip().splitlines() or [''])[0][:300]} (traceback: {log}; finished stages are kept, "
                "the same command resumes; please report this with the traceback)",
                err=True,
            )
            ctx.exit(1)


def _write_crash_log(exc: BaseException) -> Path:
    """The traceback of an unexpected error, in quantforge's cache (the terminal gets one line)."""
    import tempfile
    import time
    import traceback

    from .source import cache_root

    try:
        folder = cache_root() / "logs"
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        folder = Path(tempfile.gettempdir())
    log = folder / f"crash-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    log.write_text("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    return log


# build --help in sections (its ~45 options in one list were hard to read); tests/test_settings.py checks that
# every option of build has one.
HELP_SECTIONS = {
    "Source": ("recipe_file", "revision", "trust_remote_code", "allow_pickle"),
    "Formats": ("formats", "backends", "group_size", "act_order", "layer_resume", "quantize_dtype"),
    "Calibration": ("calibration", "calib_samples", "calib_seqlen", "calib_seed"),
    "Evaluation": (
        "eval_text", "ppl_context", "ppl_windows", "ppl_scoring", "tasks", "tasks_data", "limit", "kv_cache",
        "speed", "prompt_tokens", "gen_tokens", "threads", "device",
    ),
    "Targets": (
        "max_ppl_increase", "max_kld", "min_top1_agreement", "min_recovery", "min_task_recovery", "max_size_gb",
        "min_decode_tps", "gpu", "context", "concurrency", "runtime", "require_recommendation",
    ),
    "Output": ("out", "force", "plan_only", "as_json", "push_to_hub", "private", "gguf_repos", "split_size"),
}  # fmt: skip


class SectionedCommand(click.Command):
    """A command whose --help lists its options under HELP_SECTIONS' headings."""

    def format_options(self, ctx, formatter) -> None:
        section_of = {name: title for title, names in HELP_SECTIONS.items() for name in names}
        records: dict[str, list] = {title: [] for title in [*HELP_SECTIONS, "Other options"]}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx) if isinstance(param, click.Option) else None  # MODEL: in Usage
            if record:
                title = "Output" if "--help" in param.opts else section_of.get(param.name or "", "Other options")
                records[title].append(record)
        for title, rows in records.items():
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


@click.group(cls=QuantforgeGroup)
@click.version_option(__version__, prog_name="quantforge")
def main() -> None:
    """Quantize a causal LM into deployable formats, measure each one, and recommend which to ship."""
    _pin_the_hugging_face_cache()
    _quiet_libraries()


@main.command(cls=SectionedCommand)
@click.argument("model", required=False)
@click.option("--out", type=click.Path(path_type=Path), help="Run directory. Default: runs/<model name>.")
@click.option("--recipe", "recipe_file", type=click.Path(path_type=Path), help="A recipe YAML file.")
@click.option("--force", is_flag=True, help="Redo every stage, even those finished with the same inputs.")
@click_options
@target_options
@click.option(
    "--plan-only",
    is_flag=True,
    help="Print each stage's predicted memory, disk and time on this host, and stop (no weights downloaded).",
)
@click.option(
    "--push-to-hub",
    "push_to_hub",
    metavar="ORG/NAME",
    help="After the build, upload every finished artifact with its model card (ORG/NAME-GPTQ-Int4, ORG/NAME-GGUF).",
)
@push_options
@click.option("--json", "as_json", is_flag=True, help="Print the card as JSON on stdout.")
def build(
    model,
    out,
    recipe_file,
    force,
    plan_only,
    push_to_hub,
    private,
    gguf_repos,
    split_size,
    as_json,
    require_recommendation,
    **rest,
):
    """Fetch MODEL (a recipe, Hub id, local folder or bundled model), quantize, evaluate, write the card."""
    from .pipeline import BuildRequest
    from .pipeline import build as run_build
    from .settings import BY_NAME, from_command_line
    from .ui import UI

    settings = from_command_line({name: rest.pop(name) for name in list(rest) if name in BY_NAME})
    request = BuildRequest(
        model=model,
        out=out,
        recipe_file=recipe_file,
        force=force,
        targets=target_overrides(**rest),
        settings=settings,
        command="quantforge " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
    )
    if plan_only:
        _print_resource_plan(request, as_json)
        return
    split_bytes = _check_push(push_to_hub, split_size)
    ui = UI()
    card = run_build(request, ui)
    _print_card(card, as_json, ui)
    if push_to_hub:
        _push(Path(card["provenance"]["run_dir"]), push_to_hub, private, gguf_repos, split_bytes, as_json)
    _exit_if_failed(card)
    _exit_if_no_recommendation(card, require_recommendation)


def _print_resource_plan(request, as_json: bool) -> None:
    """--plan-only: the table (or JSON), then exit 0 when the host can hold it, 2 with the refusal when not."""
    from .pipeline import resource_plan_only

    plan = resource_plan_only(request)
    if as_json:
        click.echo(json.dumps(plan, indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        model, total, host = plan["model"], plan["total"], plan["host"]
        table = Table(title=f"{model['name']}: {model['parameters'] / 1e9:.2f}B parameters ({model['dtype']})")
        table.add_column("stage", no_wrap=True)
        for column in ("time", "peak RAM", "VRAM", "disk"):
            table.add_column(column, justify="right", no_wrap=True)
        table.add_column("note")
        for stage in plan["stages"]:
            vram = f"{stage['vram_bytes'] / 1e9:.2f} GB" if stage["vram_bytes"] else ""
            disk = f"{stage['disk_bytes'] / 1e9:.2f} GB" if stage["disk_bytes"] else ""
            table.add_row(
                stage["key"],
                f"{stage['seconds']:.0f} s",
                f"{stage['peak_rss_bytes'] / 1e9:.2f} GB",
                vram,
                disk,
                stage["note"],
            )
        Console().print(table)
        available = host["memory_available"]
        click.echo(
            f"total: about {total['seconds'] / 60:.1f} min, peak {total['peak_rss_bytes'] / 1e9:.2f} GB RAM "
            f"({total['peak_stage']}; {total['peak_beyond_libraries_over_bf16']:.2f}x the bf16 weights beyond the "
            f"libraries), "
            f"{total['disk_bytes'] / 1e9:.2f} GB disk; host: {host['gemm_gflops']:.0f} GFLOP/s float32, "
            + (f"{host['ggml_gflops']:.0f} GFLOP/s llama.cpp Q8_0, " if host.get("ggml_gflops") else "")
            + (f"{available / 1e9:.1f} GB available" if available else "memory unknown")
            + f", device {plan['device']}"
        )
        chosen = plan["quantize_dtype"]
        if chosen["formats"]:
            click.echo(f"GPTQ calibration arithmetic: {chosen['dtype']} ({chosen['why']})")
    if not plan["fits"]:
        raise QuantforgeError(plan["refusal"])


def _exit_if_failed(card: dict) -> None:
    """Formats that failed in their library: each named in one line, exit 3 (the others are on the card)."""
    failed = card.get("failed") or []
    for failure in failed:
        click.echo(f"failed: {failure['line']}", err=True)
    if failed:
        click.echo(
            f"{len(failed)} format(s) failed; the card covers the others. Run the same command again to retry "
            "only what failed.",
            err=True,
        )
        raise SystemExit(EXIT_FORMATS_FAILED)


def _exit_if_no_recommendation(card: dict, required: bool) -> None:
    """--require-recommendation: exit 4 when nothing meets the targets (the card is written all the same)."""
    if required and not card["decision"]["recommended"]:
        click.echo(f"no format meets the targets: {card['decision'].get('closest')}", err=True)
        raise SystemExit(EXIT_NO_RECOMMENDATION)


def _print_card(card: dict, as_json: bool, ui) -> None:
    if as_json:
        click.echo(json.dumps(card, indent=2))
        return
    decision = card["decision"]
    ui.log("")
    for verdict in decision["verdicts"]:
        marker = "[green]✔[/green]" if verdict["outcome"] == "recommended" else "·"
        ui.log(f"{marker} {verdict['key']}: {verdict['reason']}")
    if decision["recommended"]:
        click.echo(f"recommended: {decision['recommended']}")
        if decision.get("smallest") and decision["smallest"] != decision["recommended"]:
            click.echo(f"smallest meeting the targets: {decision['smallest']}")
    else:
        click.echo(f"recommended: none ({decision.get('closest')})")
    click.echo(f"card: {Path(card['provenance'].get('run_dir', '.')) / 'card.md'}")


@main.command()
@click.option(
    "--sdist",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A llama-cpp-python sdist already downloaded (default: fetch it with pip).",
)
@click.option(
    "--tools",
    is_flag=True,
    help="Also build llama.cpp's llama-imatrix and llama-quantize (imatrix GGUFs) and llama-perplexity (minutes).",
)
def setup(sdist, tools):
    """Fetch llama.cpp's GGUF converter for the installed llama-cpp-python into the cache (once; then offline)."""
    from .backends.llamacpp.convert import describe, install_converter, supported_architectures

    folder = install_converter(sdist)
    click.echo(f"{describe()}: {folder} ({len(supported_architectures())} architectures)")
    if tools:
        from .backends.llamacpp.tools import SETUP_TOOLS, build_tools

        for name, path in build_tools(SETUP_TOOLS, sdist=sdist, log=lambda line: click.echo(line, err=True)).items():
            click.echo(f"{name}: {path}")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def formats(as_json):
    """List every known format, its backend, and whether it can run on this host."""
    from .backends import default_backend_name, load_backends

    backends = load_backends()
    rows = []
    for backend_name, backend in backends.items():
        reason = backend.unavailable_reason()
        for name, fmt in backend.formats.items():
            rows.append(
                {
                    "format": name,
                    "backend": backend_name,
                    "default": default_backend_name(name, backends) == backend_name,
                    "scheme": fmt.scheme,
                    "family": fmt.family,
                    "runtimes": list(fmt.runtimes),
                    "available": reason is None,
                    "reason": reason,
                }
            )
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for row in rows:
        state = "ready" if row["available"] else f"unavailable: {row['reason']}"
        default = "" if row["default"] else " (alternative backend)"
        click.echo(
            f"{row['format']:<11} {row['backend']:<14} {row['scheme']:<32} "
            f"{'/'.join(row['runtimes']):<22} {state}{default}"
        )


@main.command()
@click.argument("run_dir", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--to", "repo", required=True, metavar="ORG/NAME", help="Repo name; each format adds its suffix.")
@push_options
@click.option("--json", "as_json", is_flag=True, help="Print what was pushed as JSON.")
def push(run_dir, repo, private, gguf_repos, split_size, as_json):
    """Upload the finished artifacts of RUN_DIR to the Hugging Face Hub (token from HF_TOKEN or 'hf auth login')."""
    split_bytes = _check_push(repo, split_size)
    report = _push(run_dir.resolve(), repo, private, gguf_repos, split_bytes, as_json)
    if as_json:
        click.echo(json.dumps(report, indent=2))


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def definitions(as_json):
    """List the recipes, perplexity texts, calibration sets and lm-eval tasks, and the file each comes from."""
    from .paths import find_definitions

    kinds = {
        "recipes": find_definitions("recipes"),
        "texts": find_definitions("evals/text"),
        "calibration": find_definitions("calibration"),
        "tasks": find_definitions("evals/tasks"),
    }
    if as_json:
        click.echo(json.dumps({kind: {n: str(p) for n, p in found.items()} for kind, found in kinds.items()}, indent=2))
        return
    for kind, found in kinds.items():
        click.echo(f"{kind}:")
        for name, path in found.items():
            click.echo(f"  {name:<22} {path}")


@main.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@target_options
@click.option("--json", "as_json", is_flag=True, help="Print the card as JSON.")
def card(run_dir, as_json, require_recommendation, **targets):
    """Re-decide and re-render the card of a run from its stored measurements (optionally with new targets)."""
    from .card import write_card
    from .decide import Targets
    from .ui import UI

    if not (run_dir / MANIFEST_NAME).exists():
        raise QuantforgeError(f"{run_dir} holds no quantforge run (no {MANIFEST_NAME}); run 'quantforge build' first")
    stored = json.loads((run_dir / MANIFEST_NAME).read_text()).get("plan", {}).get("targets") or {}
    result = write_card(run_dir, Targets(**{**stored, **target_overrides(**targets)}))
    _print_card(result, as_json, UI())
    _exit_if_no_recommendation(result, require_recommendation)


@main.command()
@click.argument("release_file", type=click.Path(path_type=Path))
@click.option(
    "--executor",
    type=click.Choice(["local", "ray"]),
    default="local",
    show_default=True,
    help="local: in this process, in order; ray: tasks on a Ray cluster.",
)
@click.option(
    "--address", help="Ray cluster address (e.g. ray://head:10001 or 127.0.0.1:6379); default: start a local cluster."
)
@click.option("--dry-run", is_flag=True, help="Print the plan (every unit, its resources, what is done) and stop.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan or the outcome as JSON.")
def release(release_file, executor, address, dry_run, as_json):
    """Run a release: several models x formats, each model into its own run directory, with one card each."""
    from .release import EXECUTORS, RayExecutor, check_pushes, describe_failure, load_release, plan_release
    from .ui import UI

    if address and executor != "ray":
        raise QuantforgeError("--address is for --executor ray")
    spec = load_release(release_file)
    units, _ = plan_release(spec)
    if dry_run:
        rows = [{"unit": u.id, "depends": u.depends, "resources": u.resources, "done": u.done} for u in units]
        if as_json:
            click.echo(json.dumps({"release": spec.name, "out": str(spec.out), "units": rows}, indent=2))
            return
        click.echo(f"release {spec.name} -> {spec.out} ({len(spec.models)} models, {len(units)} units)")
        for unit in units:
            memory = unit.resources.get("memory_bytes")
            needs = f"cpus={unit.resources['cpus']} gpus={unit.resources['gpus']}" + (
                f" memory~{memory / 1e9:.1f}GB" if memory else ""
            )
            after = f" after {', '.join(unit.depends)}" if unit.depends else ""
            click.echo(f"  {'done   ' if unit.done else 'pending'} {unit.id:<40} {needs}{after}")
        return
    check_pushes(spec)
    runner = RayExecutor(address) if executor == "ray" else EXECUTORS[executor]()
    ui = UI()
    models = {m.name: [u for u in units if u.model == m.name] for m in spec.models}
    with ui:
        bars = {name: ui.progress.add_task(f"{name}", total=len(model_units)) for name, model_units in models.items()}

        def report(outcome):
            ui.progress.advance(bars[outcome.unit.model])
            if outcome.status == "failed":
                ui.log(f"[red]✗[/red] {outcome.unit.id}: {outcome.reason}")

        outcomes = runner.run(spec, units, report)
    failed = [o for o in outcomes if o.status == "failed"]
    blocked = [o for o in outcomes if o.status.startswith("not run")]
    if as_json:
        click.echo(
            json.dumps(
                {
                    "release": spec.name,
                    "outcomes": [{"unit": o.unit.id, "status": o.status, "reason": o.reason} for o in outcomes],
                },
                indent=2,
            )
        )
    for model in spec.models:
        card = RunDir(spec.out / model.name).card
        if card.exists() and not any(o.unit.model == model.name for o in failed + blocked):
            recommended = json.loads(card.read_text())["decision"]["recommended"]
            click.echo(
                f"{model.name}: recommended {recommended or 'none'} ({card.parent / CARD_MARKDOWN})", err=as_json
            )
    for outcome in failed:
        click.echo(f"failed: {describe_failure(spec, outcome)}", err=True)
    if blocked:
        click.echo(f"{len(blocked)} unit(s) not run because a unit they depend on failed", err=True)
    if failed:
        raise SystemExit(EXIT_FORMATS_FAILED)


if __name__ == "__main__":
    main()

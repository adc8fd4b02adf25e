"""The recommendation, as a pure function of measurements and targets: no torch, no files, no network.

Formats are ordered by how aggressive they are, measured from the artifact (effective bits per weight over all
tensors), not by name. The least aggressive format that meets every target wins, so INT8 beats INT4 whenever INT8
is good enough. Files of equal size (the plain, importance-matrix and AutoRound GGUFs of one type hold the same
tensor bytes) are ordered by measured quality: KL divergence, then perplexity change. The smallest file that meets
every target is named beside the recommendation. A target whose metric was not measured is "unverified" and never
counts as met.

Where a metric has a 95% interval (uncertainty.py), each check also says whether the target is met, missed or
"within noise" (the interval holds values on both sides of the limit). The decision itself stays on the point
estimates, so it does not move with the confidence level; a recommendation or a rejection that rests on a
within-noise call says so, with about how many more windows or examples would settle it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .gpus import kernels_run


@dataclass(frozen=True)
class Candidate:
    key: str  # the artifact's name in the run, e.g. "gguf-q4km" or "gguf-q4km@autoround"
    family: str  # "gguf" or "hf"
    runtimes: tuple[str, ...]
    bits_per_weight: float
    size_bytes: int
    metrics: dict  # perplexity_increase_pct, kld_mean, top1_agreement, ... (absent when not measured)
    intervals: dict = field(default_factory=dict)  # metric -> {"low", "high", "n", "unit"} (uncertainty.py)
    gpu_generations: tuple[str, ...] = ()  # where its kernels run it as made (empty: everywhere); Format's
    gpu_weight_only: tuple[str, ...] = ()  # where they run its weights alone


@dataclass(frozen=True)
class Target:
    """One limit on one metric: ``metric`` must be <= ``limit`` (``upper``) or >= ``limit``."""

    name: str  # the flag users know it by
    metric: str
    limit: float
    upper: bool
    unit: str = ""

    def describe(self, value: float) -> str:
        sign = "<=" if self.upper else ">="
        return f"{self.metric} {_fmt(value)}{self.unit} (target {sign} {_fmt(self.limit)}{self.unit})"


# The runtimes of quantforge's own backends; a build or card checks against those of the loaded backends
# (backends.known_runtimes), so a plugin's runtime is a valid --runtime too.
RUNTIMES = ("any", "vllm", "transformers", "llama.cpp", "ollama")


@dataclass
class Targets:
    # The defaults, one on the mean and one on the whole distribution. Perplexity alone passed a file that agreed
    # with the reference on 43% of top tokens (tiny random llama: Q4_K_M at +0.006% perplexity, KLD 0.079; on
    # flatter models perplexity barely moves). KLD 0.1 passes the 4-bit files that serve well (SmolLM2-135M
    # Q4_K_M 0.060 plain, 0.038 with an importance matrix; 7-8B models' Q4_K_M sit lower still) and stops GPTQ int4
    # without calibration care (SmolLM2 0.168, +19.9% perplexity) and broken files (0.6).
    max_ppl_increase: float | None = 5.0  # percent
    max_kld: float | None = 0.1
    min_top1_agreement: float | None = None  # 0-1
    min_recovery: float | None = None  # mean task recovery, percent
    min_task_recovery: dict[str, float] = field(default_factory=dict)  # per task, percent
    max_size_gb: float | None = None
    min_decode_tps: float | None = None  # measured on this host, in the format's own runtime
    gpu: str | None = None  # a name from the GPU table or a size such as "20GB"
    context: int = 4096  # tokens per sequence the GPU must hold (with --gpu)
    concurrency: int = 1  # sequences at once (with --gpu)
    runtime: str = "any"

    def problems(self, runtimes: tuple[str, ...] = RUNTIMES) -> list[str]:
        """Targets that cannot be met by any measurement, as one-line messages (``runtimes``: the known ones)."""
        problems = []
        flags = {"max_ppl_increase": "--max-ppl-increase", "max_kld": "--max-kld", "max_size_gb": "--max-size"}
        for name, flag in {**flags, "min_decode_tps": "--min-decode-tps"}.items():
            value = getattr(self, name)
            if value is not None and value < 0:
                problems.append(f"{flag} must not be negative (got {value})")
        if self.max_size_gb is not None and self.max_size_gb == 0:
            problems.append("--max-size must be more than 0 GB")
        if self.min_top1_agreement is not None and not 0 <= self.min_top1_agreement <= 1:
            problems.append(f"--min-top1-agreement is a fraction between 0 and 1 (got {self.min_top1_agreement})")
        for label, value in [("--min-recovery", self.min_recovery), *self.min_task_recovery.items()]:
            if value is not None and not 0 <= value <= 200:
                problems.append(f"{label} is a percentage of the reference's accuracy, 0-200 (got {value})")
        if self.context < 1 or self.concurrency < 1:
            problems.append("--context and --concurrency must be at least 1")
        if self.runtime not in runtimes:
            problems.append(f"unknown runtime '{self.runtime}'; choose one of {', '.join(runtimes)}")
        return problems

    def limits(self, usable_gpu_gb: float | None = None) -> list[Target]:
        limits = []
        if self.max_ppl_increase is not None:
            limits.append(Target("max_ppl_increase", "perplexity_increase_pct", self.max_ppl_increase, True, "%"))
        if self.max_kld is not None:
            limits.append(Target("max_kld", "kld_mean", self.max_kld, True))
        if self.min_top1_agreement is not None:
            limits.append(Target("min_top1_agreement", "top1_agreement", self.min_top1_agreement, False))
        if self.min_recovery is not None:
            limits.append(Target("min_recovery", "task_recovery_pct", self.min_recovery, False, "%"))
        for task, value in sorted(self.min_task_recovery.items()):
            limits.append(Target(f"min_recovery[{task}]", f"task_recovery_pct[{task}]", value, False, "%"))
        if self.max_size_gb is not None:
            limits.append(Target("max_size_gb", "size_gb", self.max_size_gb, True, " GB"))
        if self.min_decode_tps is not None:
            limits.append(Target("min_decode_tps", "decode_tps", self.min_decode_tps, False, " tok/s"))
        if self.gpu is not None and usable_gpu_gb is not None:
            limits.append(Target("gpu", "gpu_needed_gb", usable_gpu_gb, True, " GB"))
        return limits

    def to_json(self) -> dict:
        return asdict(self)

    def defaults(self) -> set[str]:
        """Names of the targets left at quantforge's default values (the card says which they are)."""
        default = Targets()
        return {name for name, value in asdict(self).items() if value is not None and value == getattr(default, name)}


@dataclass
class Verdict:
    key: str
    outcome: str  # "recommended", "meets targets", "misses targets", "excluded", "failed"
    reason: str
    checks: list[dict] = field(default_factory=list)


@dataclass
class Decision:
    recommended: str | None
    verdicts: list[Verdict]  # in order of aggressiveness, least aggressive first
    best_per_family: dict[str, str]
    closest: str | None = None  # when nothing meets the targets: which format came nearest, and how
    smallest: str | None = None  # the most aggressive format that meets every target (the closest of equal size)

    def to_json(self) -> dict:
        return asdict(self)


def _fmt(value: float) -> str:
    if value == 0 or abs(value) >= 100:
        return f"{value:.1f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    return f"{value:.4g}"


def _value(candidate: Candidate, metric: str) -> float | None:
    if metric == "size_gb":
        return candidate.size_bytes / 1e9
    return candidate.metrics.get(metric)


# Bits per weight equal to this many decimals are the same size: the same tensor types, whatever made them.
SAME_SIZE_DECIMALS = 3


def _rank(candidate: Candidate) -> tuple:
    """Least aggressive first; equal sizes by measured quality (an unmeasured metric ranks last); the key breaks
    what remains, so the order never depends on input order."""
    missing = float("inf")
    kld = candidate.metrics.get("kld_mean")
    ppl = candidate.metrics.get("perplexity_increase_pct")
    return (
        -round(candidate.bits_per_weight, SAME_SIZE_DECIMALS),
        missing if kld is None else kld,
        missing if ppl is None else ppl,
        candidate.key,
    )


def _same_size(a: Candidate, b: Candidate) -> bool:
    return round(a.bits_per_weight, SAME_SIZE_DECIMALS) == round(b.bits_per_weight, SAME_SIZE_DECIMALS)


def _farther(candidate: Candidate, closer: Candidate) -> str:
    """ "same size as X, farther from the reference: KLD a against b" (the measure that ranked them)."""
    for metric, label in (("kld_mean", "KLD"), ("perplexity_increase_pct", "perplexity change")):
        mine, theirs = candidate.metrics.get(metric), closer.metrics.get(metric)
        if mine is not None and theirs is not None and mine != theirs:
            return f"same size as {closer.key}, farther from the reference: {label} {_fmt(mine)} against {_fmt(theirs)}"
    return f"same size as {closer.key}, not measured closer to the reference"


def _check(candidate: Candidate, target: Target) -> dict:
    from .uncertainty import status

    value = _value(candidate, target.metric)
    check = {"target": target.name, "metric": target.metric, "value": value, "limit": target.limit, "met": None}
    if value is None:
        return {**check, "status": "unverified"}
    interval = candidate.intervals.get(target.metric)
    check["met"] = value <= target.limit if target.upper else value >= target.limit
    check["status"] = status(value, interval, target.limit, target.upper)
    if interval:
        check["interval"] = [interval["low"], interval["high"]]
    return check


def _noise_note(candidate: Candidate, checks: list[dict], by_name: dict) -> str:
    """ "; within noise: <metric> <value> [low, high] vs <limit>, about N more windows would settle it" or ""."""
    from .uncertainty import samples_to_settle

    notes = []
    for check in checks:
        if check.get("status") != "within noise":
            continue
        target = by_name[check["target"]]
        interval = candidate.intervals[target.metric]
        more = samples_to_settle(check["value"], interval, target.limit)
        settle = f", about {more} more {interval['unit']} would settle it" if more else ""
        notes.append(
            f"{target.metric} {_fmt(check['value'])}{target.unit} [{_fmt(interval['low'])}, "
            f"{_fmt(interval['high'])}] vs {_fmt(target.limit)}{target.unit}{settle}"
        )
    return f"; within noise: {'; '.join(notes)}" if notes else ""


def _miss_ratio(check: dict, target: Target) -> float:
    """How far a missed target is from being met, as a fraction of its limit (0 = met, inf = unmeasured)."""
    if check["met"] is None:
        return float("inf")
    if check["met"]:
        return 0.0
    scale = abs(target.limit) or 1.0
    return abs(check["value"] - target.limit) / scale


def _weight_only_note(candidate: Candidate, gpu: tuple[str, str] | None) -> str:
    if gpu is None or kernels_run(gpu[1], candidate.gpu_generations, candidate.gpu_weight_only) != "weights alone":
        return ""
    return (
        f"; on {gpu[0]} it runs with its weights alone (activations unquantized), so the figures, measured with "
        "quantized activations, are if anything pessimistic"
    )


def _gpu_exclusion(candidate: Candidate, gpu: tuple[str, str] | None) -> str | None:
    """Why the candidate cannot run on the target GPU (its name, generation), or None."""
    if gpu is None:
        return None
    name, generation = gpu
    if kernels_run(generation, candidate.gpu_generations, candidate.gpu_weight_only) != "no":
        return None
    runs_on = ", ".join(g.capitalize() for g in candidate.gpu_generations)
    return f"does not run on {name} ({generation.capitalize()}): its kernels run on {runs_on} GPUs"


def decide(
    candidates: list[Candidate],
    targets: Targets,
    usable_gpu_gb: float | None = None,
    failures: dict[str, str] | None = None,
    gpu: tuple[str, str] | None = None,
) -> Decision:
    """``usable_gpu_gb``: what the GPU of ``targets.gpu`` offers weights and KV cache (see deploy.memory_fit);
    each candidate then carries ``gpu_needed_gb`` in its metrics. ``failures``: formats that could not be made or
    measured (key -> the one-line failure), listed last with that line as their reason. ``gpu``: the target GPU's
    name and generation (gpus.GENERATION), when it is one of the table's: formats whose kernels it lacks are
    excluded (INT8 W8A8 on Blackwell), and so INT8 before INT4 becomes FP8 before INT4 there."""
    limits = targets.limits(usable_gpu_gb)
    by_name = {t.name: t for t in limits}
    eligible, verdicts = [], []
    for candidate in candidates:
        unrunnable = _gpu_exclusion(candidate, gpu)
        if targets.runtime != "any" and targets.runtime not in candidate.runtimes:
            verdicts.append(Verdict(candidate.key, "excluded", f"does not run in {targets.runtime}"))
        elif unrunnable:
            verdicts.append(Verdict(candidate.key, "excluded", unrunnable))
        else:
            eligible.append(candidate)
    eligible.sort(key=_rank)
    ranked: list[Verdict] = []
    recommended = smallest = None
    best_per_family: dict[str, str] = {}
    for candidate in eligible:
        checks = [_check(candidate, target) for target in limits]
        failed = [c for c in checks if c["met"] is not True]
        if not failed:
            best_per_family.setdefault(candidate.family, candidate.key)
            if smallest is None or not _same_size(candidate, smallest):
                smallest = candidate  # the first (closest) file of each smaller size
            if recommended is None:
                recommended = candidate
                reason = "least aggressive format that meets every target" + (
                    f" ({candidate.bits_per_weight:.2f} bits/weight)"
                )
                reason += _noise_note(candidate, checks, by_name) + _weight_only_note(candidate, gpu)
                ranked.append(Verdict(candidate.key, "recommended", reason, checks))
            elif smallest is not candidate:  # a closer file of this size meets the targets too
                ranked.append(Verdict(candidate.key, "meets targets", _farther(candidate, smallest), checks))
            else:
                reason = (
                    f"more aggressive than needed: {candidate.bits_per_weight:.2f} bits/weight where "
                    f"{recommended.key} ({recommended.bits_per_weight:.2f}) already meets the targets"
                )
                ranked.append(Verdict(candidate.key, "meets targets", reason, checks))
            continue
        reasons = []
        for check in failed:
            target = by_name[check["target"]]
            if check["met"] is None:
                reasons.append(f"{target.metric} unverified (not measured), target {target.name}")
            else:
                reasons.append("missed " + target.describe(check["value"]))
        reason = "; ".join(reasons) + _noise_note(candidate, [c for c in failed if c["met"] is False], by_name)
        ranked.append(Verdict(candidate.key, "misses targets", reason, checks))
    if smallest is not None and smallest is not recommended:
        verdict = next(v for v in ranked if v.key == smallest.key)
        verdict.reason += "; the smallest file that meets every target"
    closest = None
    if recommended is None and ranked:

        def worst_miss(verdict: Verdict) -> float:
            return max((_miss_ratio(c, by_name[c["target"]]) for c in verdict.checks), default=0.0)

        nearest = min(ranked, key=worst_miss)
        if worst_miss(nearest) != float("inf"):
            closest = f"{nearest.key} comes closest: {nearest.reason}"
        else:
            closest = "no format has every targeted metric measured"
    verdicts += [Verdict(key, "failed", line) for key, line in sorted((failures or {}).items())]
    return Decision(
        recommended.key if recommended else None,
        ranked + verdicts,
        best_per_family,
        closest,
        smallest.key if smallest else None,
    )


def pareto_front(points: list[tuple[str, float, float]]) -> list[str]:
    """Keys of the points (key, size, loss) that no other point beats on both size and loss."""
    front = []
    for key, size, loss in points:
        dominated = any(s <= size and other <= loss and (s, other) != (size, loss) for _, s, other in points)
        if not dominated:
            front.append(key)
    return front

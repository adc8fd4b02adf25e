"""Perplexity and distribution shift, computed the same way for the reference and for every artifact.

Convention (GPTQ/AutoRound): the text is joined, tokenized once (no special tokens added), cut into
non-overlapping windows of the context length, and every position of every window after the first token is
scored (mean token negative log-likelihood; perplexity is its exponential). When the model's tokenizer puts a BOS
token in front of every text (Gemma, Llama 2/3, Mistral), each window starts with BOS followed by ``context - 1``
text tokens, so the first scored token is the window's first text token: such models see BOS in training, and
without it their perplexity is meaningless (Gemma 3 270M: 10,273 without, 982 with). llama.cpp's
``llama-perplexity`` also starts each window with BOS then, but scores only the second half of each window, so its
figures differ. ``scoring="second-half"`` scores as it does (the logits of positions ``context // 2`` to
``context - 2``, each predicting the next token), cuts the text as it does (for a BOS model: BOS + the text cut
every ``context`` tokens, each cut's first token overwritten by BOS) and reads the text as its file does
(WikiText-2's rows joined as wiki.test.raw): its running perplexity equals llama-perplexity's window by window, with
BOS and without (tests/test_evaluation.py runs llama.cpp's program). So a card's perplexity and KL sit beside
llama.cpp's published ones, and every position scored has seen at least half a window; the runtimes then compute
the output layer for those positions alone. The card says which convention it used.

The reference's next-token distribution is stored compactly, so every artifact is compared with it without
recomputing the reference: per scored position, the ``TOP_K`` most likely tokens with their log-probabilities, and
``TAIL_SAMPLES`` tokens drawn from the rest of the distribution (in proportion to their probability, from a fixed
seed) with theirs, plus the mass of that rest. KL(reference || artifact) is then the exact sum over the top tokens
plus the rest's mass times the mean log-ratio over the drawn tokens: an unbiased estimate of the full sum. Measured
on SmolLM2 Q4_K_M (llama.cpp logits): 0.05574 against 0.05586 for the full-vocabulary sum, where dropping the
rest (top-128 only, grouped) gave 0.0473 (15% low).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Union

import numpy as np

from .errors import QuantforgeError
from .uncertainty import window_sums

TOP_K = 64
TAIL_SAMPLES = 64


@dataclass(frozen=True)
class EvalSettings:
    text: str = "auto"
    context: int = 512
    windows: int = 16
    scoring: str = "all"

    @property
    def first_scored(self) -> int:
        """The first position of a window whose logits are scored (each predicts the token after it)."""
        return self.context // 2 if self.scoring == "second-half" else 0

    def to_json(self) -> dict:
        settings = {"text": self.text, "context": self.context, "windows": self.windows}
        if self.scoring != "all":  # absent for the default, so runs made before the setting existed still resume
            settings["scoring"] = self.scoring
        return settings


def cuts_like_llama_perplexity(bos: int | None, scoring: str) -> bool:
    """llama-perplexity tokenizes BOS + the text, cuts it every ``context`` tokens and overwrites each piece's first
    token with BOS: one text token at each cut is never seen. The second-half scoring reproduces that exactly."""
    return bos is not None and scoring == "second-half"


def text_tokens_needed(context: int, windows: int, bos: int | None, scoring: str = "all") -> int:
    """Text tokens (no BOS) that ``windows`` windows take."""
    if cuts_like_llama_perplexity(bos, scoring):
        return windows * context - 1
    return windows * (context - 1 if bos is not None else context)


def make_windows(
    token_ids: np.ndarray, context: int, windows: int, bos: int | None = None, scoring: str = "all"
) -> np.ndarray:
    """The first ``windows`` non-overlapping windows of ``context`` tokens, as an int32 array [windows, context].
    With ``bos``, each window is BOS followed by ``context - 1`` text tokens: the next ones (every text token is
    scored once), or for the second-half scoring those llama-perplexity's window holds (see
    ``cuts_like_llama_perplexity``)."""
    needed = text_tokens_needed(context, windows, bos, scoring)
    if len(token_ids) < needed:
        available = len(token_ids) // max(needed // windows, 1)
        raise QuantforgeError(
            f"the evaluation text has {len(token_ids)} tokens: enough for {available} windows of {context}, "
            f"not {windows}; lower --ppl-windows or --ppl-context, or use a longer text"
        )
    ids = np.asarray(token_ids[:needed], dtype=np.int32)
    if bos is None:
        return ids.reshape(windows, context)
    if cuts_like_llama_perplexity(bos, scoring):
        stream = np.concatenate([[bos], ids]).astype(np.int32).reshape(windows, context)
        stream[:, 0] = bos
        return stream
    text = ids.reshape(windows, context - 1)
    return np.concatenate([np.full((windows, 1), bos, dtype=np.int32), text], axis=1)


def bos_token_id(tokenizer_dir: Path) -> int | None:
    """The BOS id when the tokenizer puts BOS in front of every text it encodes (as the model was trained), else None.

    Asked of the tokenizer itself (its post-processor, or ``add_bos_token``), not of the config: many configs name
    a BOS token that the tokenizer never adds (Qwen, SmolLM).
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    bos = tokenizer.bos_token_id
    if bos is None:
        return None
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return int(bos) if ids and ids[0] == bos else None


BOUNDARY_MARGIN = 256  # tokens dropped before a prefix's cut, where tokenization may differ from the whole text's


def tokenize_text(tokenizer_dir: Path, text: str, needed: int | None = None) -> np.ndarray:
    """The text's token ids; with ``needed``, only the first ``needed``, from a prefix of the text that holds them.

    A run scores a few windows of a long text (wikitext-2's test split is 1.3 MB), so tokenizing all of it costs
    more than the evaluation. Tokenizers split text into words before merging, so a prefix cut at a line break
    tokenizes like the whole text except near the cut: the first ``needed`` tokens are kept only when the prefix
    holds ``BOUNDARY_MARGIN`` more, so they equal the whole text's first ``needed`` tokens.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)

    def encode(part: str) -> np.ndarray:
        return np.asarray(tokenizer(part, add_special_tokens=False)["input_ids"], dtype=np.int32)

    if needed is None:
        return encode(text)
    chars = (needed + BOUNDARY_MARGIN) * 6  # a generous guess of characters per token, doubled until it holds
    while chars < len(text):
        cut = text.find("\n", chars)
        if cut < 0:
            break
        ids = encode(text[: cut + 1])
        if len(ids) >= needed + BOUNDARY_MARGIN:
            return ids[:needed]
        chars *= 2
    return encode(text)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-probabilities; torch's kernel is about 5x faster here than the same sum in numpy."""
    import torch

    return torch.log_softmax(torch.from_numpy(np.ascontiguousarray(logits)).double(), dim=-1).numpy()


@dataclass
class ReferenceWindow:
    """What is kept of the reference's prediction at each scored position of one window."""

    nll: np.ndarray  # [n] float64
    top_ids: np.ndarray  # [n, TOP_K] int32, most likely first
    top_logp: np.ndarray  # [n, TOP_K] float32
    tail_ids: np.ndarray  # [n, TAIL_SAMPLES] int32, drawn from the rest of the distribution
    tail_logp: np.ndarray  # [n, TAIL_SAMPLES] float32
    tail_mass: np.ndarray  # [n] float64, probability outside the top tokens


# Positions per log-softmax: bounds the float64 scratch (a 150k vocabulary: 10 MB a buffer). Every step is row by
# row and the tail draws come from one stream in row order, so the size never changes a figure (checked bit for bit
# at 8, 16 and 32 rows). Small chunks need the reused buffers (``ChunkScratch``): with fresh temporaries for every
# chunk, 8 rows put many 5-10 MB blocks on glibc's heap, which fragmented (the 0.5B reference peaked 1 GB higher).
# With them, 8 rows took SmolLM2's whole-build reference peak from 1.003 GB (16 rows) to 0.979 GB, the stored
# reference and every figure bit for bit the same.
ROW_CHUNK = 8

LogitRows = Union[np.ndarray, Iterable[np.ndarray]]


def scored_logit_blocks(runner, tokens: np.ndarray, first: int = 0) -> LogitRows:
    """The logits of a window's scored positions (``first`` to the last but one) from ``runner``: in blocks when it
    offers ``scored_logits`` (each block valid until the next is asked for, so a window's logits need not be held
    whole), else cut from its whole ``logits`` array. A runner whose ``scored_logits`` takes no ``first`` (a plugin
    written before it existed) has its leading rows dropped here."""
    if not hasattr(runner, "scored_logits"):
        return runner.logits(tokens)[first:]
    if not first:
        return runner.scored_logits(tokens)
    if "first" in inspect.signature(runner.scored_logits).parameters:
        return runner.scored_logits(tokens, first=first)
    return _drop_rows(runner.scored_logits(tokens), first)


def _drop_rows(blocks: LogitRows, count: int) -> Iterator[np.ndarray]:
    """``blocks`` without their first ``count`` rows."""
    for block in [blocks] if isinstance(blocks, np.ndarray) else blocks:
        kept = block[count:]
        count = max(0, count - len(block))
        if len(kept):
            yield kept


def last_logits(runner, tokens: np.ndarray, rows: int) -> np.ndarray:
    """The logits of a window's last ``rows`` positions from ``runner``: computed for those alone when it offers
    ``last_logits`` (a task's continuation needs a few rows of a window's logits), else cut from its ``logits``."""
    if hasattr(runner, "last_logits"):
        return runner.last_logits(tokens, rows)
    return runner.logits(tokens)[-rows:]


def _row_blocks(logits: LogitRows, scored: int):
    """(first position, rows) of ``ROW_CHUNK`` rows (fewer only at the end) for the ``scored`` positions, in order,
    from an array of every position's logits or from consecutive blocks of rows of any size.

    The rows are grouped alike however the runner cut them (a chunk straddling two blocks is copied together), so
    the figures do not depend on the cut: torch reduces a single row differently from several.
    """
    blocks = [logits] if isinstance(logits, np.ndarray) else logits
    start, carried = 0, None  # carried: a copy of the rows left at the end of the previous block
    for block in blocks:
        block = block[: scored - start - (0 if carried is None else len(carried))]
        if carried is not None:
            take = ROW_CHUNK - len(carried)
            carried = np.concatenate([carried, block[:take]])
            block = block[take:]
            if len(carried) < ROW_CHUNK and start + len(carried) < scored:
                continue
            yield start, carried
            start, carried = start + len(carried), None
        whole, chunk = len(block) - len(block) % ROW_CHUNK, None
        for offset in range(0, whole, ROW_CHUNK):
            chunk = block[offset : offset + ROW_CHUNK]
            # The block's last chunk goes out as a copy: a view would keep the whole block alive in the caller
            # while the runner makes the next one (a torch block of 128 rows x 152k: 78 MB held twice).
            yield start, (chunk if offset + ROW_CHUNK < len(block) else np.array(chunk))
            start += ROW_CHUNK
        if whole < len(block):
            carried = np.array(block[whole:])  # the block's buffer may be overwritten by the next decode
        del block, chunk  # nothing here holds the block while the next is made
    if carried is not None:
        yield start, carried
        start += len(carried)
    if start != scored:
        raise ValueError(f"the runner gave logits for {start} positions, not the {scored} scored")


class ChunkScratch:
    """The float64 work of one row chunk, in buffers made once per window and reused for every chunk.

    Fresh temporaries for every chunk (the widened rows, their log-probabilities, their exponentials, the running
    sums the tail is drawn from: at 32 rows, 13 MB each for a 49k vocabulary, 39 MB for 152k) interleaved with the
    forward's own allocations on glibc's heap, which fragmented and was not reused: the 135M reference's peak
    varied by 300 MB from run to run. Each step writes into its buffer with the same kernel it used before, so no
    figure changes.
    """

    def __init__(self, vocab: int):
        import torch

        shape = (ROW_CHUNK, vocab)
        self.wide = torch.empty(shape, dtype=torch.float64)
        self.logp = torch.empty(shape, dtype=torch.float64)
        self.probs = np.empty(shape)  # first the negated log-probabilities that the top tokens are picked from
        self.cumulative = self.wide.numpy()  # the widened rows are spent once their log-probabilities are made

    def log_softmax(self, rows: np.ndarray) -> np.ndarray:
        """``log_softmax(rows)``, computed in this scratch; valid until the next call."""
        import torch

        wide, logp = self.wide[: len(rows)], self.logp[: len(rows)]
        wide.copy_(torch.from_numpy(np.ascontiguousarray(rows)))
        return torch.log_softmax(wide, dim=-1, out=logp).numpy()


def _row_chunks(logits: LogitRows, targets: np.ndarray, scratch: ChunkScratch):
    """(log-probs, targets) for the scored positions of a window, a few rows at a time (each log-prob array is
    ``scratch``'s, valid until the next is asked for)."""
    for start, rows in _row_blocks(logits, len(targets)):
        yield scratch.log_softmax(rows), targets[start : start + len(rows)]


def _sample_tail(probs: np.ndarray, rng: np.random.Generator, samples: int, scratch: np.ndarray) -> np.ndarray:
    """For each row, ``samples`` token ids drawn in proportion to ``probs`` (rows need not sum to 1); ``scratch``,
    with at least as many rows as ``probs``, holds the running sums."""
    cumulative = np.cumsum(probs, axis=-1, out=scratch[: len(probs)])
    totals = cumulative[:, -1:].copy()
    draws = rng.random((len(probs), samples)) * totals
    rows = np.arange(len(probs))[:, None]
    # One flat search over all rows: offset each row's cumulative sums past the previous row's total.
    offsets = np.concatenate([[0.0], np.cumsum(totals[:-1, 0])])[:, None]
    flat = np.add(cumulative, offsets, out=cumulative).ravel()
    ids = np.searchsorted(flat, (draws + offsets).ravel(), side="right").reshape(draws.shape) - rows * probs.shape[1]
    return np.clip(ids, 0, probs.shape[1] - 1)


def _vocab_size(logits: LogitRows) -> tuple[int, LogitRows]:
    """The vocabulary size of a window's logits, and the logits still whole (a generator's first block is put back)."""
    if isinstance(logits, np.ndarray):
        return logits.shape[-1], logits
    blocks = iter(logits)
    first = next(blocks, None)
    if first is None:  # no rows at all: _row_blocks says how many were expected
        return 0, iter(())
    return first.shape[-1], _put_back(first, blocks)


def _put_back(first: np.ndarray, blocks: Iterator[np.ndarray]) -> Iterator[np.ndarray]:
    """``first`` then ``blocks``, keeping no hold on ``first`` once it is given (``itertools.chain([first], ...)``
    keeps its list, so the first block lived, 78 MB at a 152k vocabulary, until the window's last)."""
    held = [first]
    del first
    yield held.pop()
    yield from blocks


class NonFiniteLogits(QuantforgeError):
    """A window's figures came out NaN or infinite: its logits hold NaN or infinity where it matters, and no mean,
    interval or recommendation built on them would mean anything (a NaN perplexity once reached the card as
    "missed perplexity_increase_pct nan%"). The message says where it was first seen."""

    def __init__(self, what: str, window: int, position: int, value: float):
        super().__init__(
            f"{what} at window {window + 1}, position {position + 1} is {value}: its logits hold NaN or infinity"
        )


def check_finite(whose: str, window: int, **figures: np.ndarray) -> None:
    """Raise ``NonFiniteLogits`` at the first position where any of ``figures`` is NaN or infinite.

    A -inf logit alone (a vocabulary entry the model masks out) passes: it leaves every figure finite unless the
    model gives it to the token that came next, which is a real infinite loss and is reported as one.
    """
    for name, values in figures.items():
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            row = int(bad[0])
            what = f"{whose} {name.replace('_', ' ')}"
            raise NonFiniteLogits(what, window, row, float(values[row]))


def reference_window(
    logits: LogitRows,
    tokens: np.ndarray,
    seed: int = 0,
    top_k: int = TOP_K,
    tail_samples: int = TAIL_SAMPLES,
    first: int = 0,
) -> ReferenceWindow:
    """What is kept of the reference's prediction at each scored position of one window: ``logits`` are those of
    positions ``first`` to the window's last but one."""
    rng = np.random.default_rng(seed)
    vocab, logits = _vocab_size(logits)
    scratch = ChunkScratch(vocab)
    parts: dict[str, list] = {k: [] for k in ("nll", "top_ids", "top_logp", "tail_ids", "tail_logp", "tail_mass")}
    for logp, targets in _row_chunks(logits, tokens[first + 1 :], scratch):
        rows = np.arange(len(targets))[:, None]
        parts["nll"].append(-logp[rows[:, 0], targets])
        top = np.argpartition(np.negative(logp, out=scratch.probs[: len(logp)]), top_k, axis=-1)[:, :top_k]
        top_vals = np.take_along_axis(logp, top, axis=-1)
        order = np.argsort(-top_vals, axis=-1)
        top, top_vals = np.take_along_axis(top, order, axis=-1), np.take_along_axis(top_vals, order, axis=-1)
        rest = np.exp(logp, out=scratch.probs[: len(logp)])
        rest[rows, top] = 0.0
        tail = _sample_tail(rest, rng, tail_samples, scratch.cumulative)
        parts["top_ids"].append(top.astype(np.int32))
        parts["top_logp"].append(top_vals.astype(np.float32))
        parts["tail_ids"].append(tail.astype(np.int32))
        parts["tail_logp"].append(np.take_along_axis(logp, tail, axis=-1).astype(np.float32))
        parts["tail_mass"].append(rest.sum(axis=-1))
    return ReferenceWindow(**{k: np.concatenate(v) for k, v in parts.items()})


def _artifact_logprobs(logits: np.ndarray, targets: np.ndarray, top_ids: np.ndarray, tail_ids: np.ndarray, scratch):
    """The artifact's log-probabilities at the targets and at the reference's stored tokens, and its top token.

    Only a few hundred entries per row are needed, so the full float32 row is never converted: each gathered
    logit is taken to float64 and the row's log-sum-exp is formed in float64 from the max and the sum of the
    max-shifted exponentials. That keeps KL at 1e-7 precision for a fraction of a float64 log-softmax's cost.
    ``scratch`` (a float32 tensor with at least as many rows) holds the shifted exponentials.
    """
    import torch

    rows = torch.from_numpy(np.ascontiguousarray(logits, dtype=np.float32))
    peak, argmax = rows.max(dim=-1, keepdim=True)
    shifted = torch.sub(rows, peak, out=scratch[: len(rows)])
    # float32 exp and (cascade) sum of terms <= 1 are accurate to ~1e-7 relative; the log and the shift are float64.
    lse = peak.double() + shifted.exp_().sum(dim=-1, keepdim=True).double().log()

    def gather(ids: np.ndarray) -> np.ndarray:
        index = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))
        return (rows.gather(-1, index).double() - lse).numpy()

    return gather(targets[:, None])[:, 0], gather(top_ids), gather(tail_ids), argmax[:, 0].numpy()


def compare_window(
    logits: LogitRows, tokens: np.ndarray, ref: ReferenceWindow, first: int = 0
) -> dict[str, np.ndarray]:
    """Per-position NLL, KL(reference || artifact) and whether the top token agrees, for the positions from
    ``first`` (those ``logits`` hold and ``ref`` was made for)."""
    import torch

    targets = tokens[first + 1 :]
    vocab, logits = _vocab_size(logits)
    scratch = torch.empty((ROW_CHUNK, vocab), dtype=torch.float32)  # reused by every chunk (see ChunkScratch)
    parts: dict[str, list] = {"nll": [], "kld": [], "agree": []}
    for start, block in _row_blocks(logits, len(targets)):  # a few rows at a time: bounded scratch memory
        rows = slice(start, start + len(block))
        picked, top_logq, tail_logq, argmax = _artifact_logprobs(
            block, targets[rows], ref.top_ids[rows], ref.tail_ids[rows], scratch
        )
        top_logp, tail_logp = ref.top_logp[rows].astype(np.float64), ref.tail_logp[rows].astype(np.float64)
        top_term = (np.exp(top_logp) * (top_logp - top_logq)).sum(axis=-1)
        tail_term = ref.tail_mass[rows] * (tail_logp - tail_logq).mean(axis=-1)
        parts["nll"].append(-picked)
        parts["kld"].append(top_term + tail_term)
        parts["agree"].append(argmax == ref.top_ids[rows, 0])
    return {name: np.concatenate(values) for name, values in parts.items()}


def summarize(nll: np.ndarray, kld: np.ndarray | None = None, agree: np.ndarray | None = None) -> dict:
    mean_nll = float(np.mean(nll))
    summary = {
        "perplexity": float(np.exp(mean_nll)),
        "nll_mean": mean_nll,
        # Standard error of the mean NLL carried to perplexity (delta method), as llama.cpp reports it.
        "perplexity_stderr": float(np.exp(mean_nll) * np.std(nll) / np.sqrt(len(nll))),
        "tokens_scored": int(len(nll)),
    }
    if kld is not None:
        # The mean only: each position's KL is an estimate (its top tokens exact, its tail sampled), unbiased for
        # the mean but noisy one by one (some come out negative), so a percentile of them (p99, median) would
        # not be the distribution's and is not reported.
        summary.update(kld_mean=float(np.mean(kld)), top1_agreement=float(np.mean(agree)))
    return summary


REFERENCE_FIELDS = ("nll", "top_ids", "top_logp", "tail_ids", "tail_logp", "tail_mass")


def save_reference(path: Path, windows: list[ReferenceWindow]) -> None:
    from .fsutil import atomic_output

    with atomic_output(path) as tmp:
        with open(tmp, "wb") as handle:
            np.savez(handle, **{name: np.stack([getattr(w, name) for w in windows]) for name in REFERENCE_FIELDS})


def load_reference(path: Path) -> list[ReferenceWindow]:
    # Each field read once: indexing the NpzFile reads the whole array again, and a window's row kept a view of
    # that copy, so W windows held W copies of the reference (136 MB for SmolLM2's 16 windows of 512, growing with
    # the square of the window count).
    with np.load(path) as data:
        fields = {name: data[name] for name in REFERENCE_FIELDS}
    return [ReferenceWindow(**{name: rows[i] for name, rows in fields.items()}) for i in range(len(fields["nll"]))]


class WindowProgress:
    """Per-window results saved as they come, so a killed evaluation resumes at the window where it stopped.

    The results of a window depend only on the model and the window, so a resumed evaluation equals an
    uninterrupted one. The file is removed once the stage is recorded.
    """

    def __init__(self, path: Path | None):
        self.path = path
        self.windows: list[dict[str, np.ndarray]] = []
        if path is not None and path.exists():
            data = np.load(path)
            count = int(data["count"]) if "count" in data else 0
            self.windows = [
                {key.split(":", 1)[1]: data[key] for key in data.files if key.startswith(f"{i}:")} for i in range(count)
            ]

    def add(self, result: dict[str, np.ndarray]) -> None:
        self.windows.append(result)
        if self.path is None:
            return
        from .fsutil import atomic_output

        arrays = {f"{i}:{name}": value for i, window in enumerate(self.windows) for name, value in window.items()}
        with atomic_output(self.path) as tmp, open(tmp, "wb") as handle:
            np.savez(handle, count=len(self.windows), **arrays)

    def finish(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def _timing(seconds: float, windows: np.ndarray, resumed: int) -> dict:
    """Time and throughput of the windows computed in this process (not those resumed from a killed run)."""
    computed = (len(windows) - resumed) * windows.shape[1]
    return {
        "eval_seconds": round(seconds, 3),
        "resumed_windows": resumed,
        "eval_tokens_per_second": round(computed / seconds, 1) if seconds and computed else None,
    }


def score_reference(
    logits_fn: Callable[[np.ndarray], LogitRows],
    windows: np.ndarray,
    on_window: Callable[[int], None] | None = None,
    progress_path: Path | None = None,
    first: int = 0,
) -> tuple[list[ReferenceWindow], dict]:
    """The reference's kept predictions for every window, and its perplexity; ``logits_fn`` gives a window's logits
    from position ``first`` (``scored_logit_blocks``)."""
    started = time.perf_counter()
    progress = WindowProgress(progress_path)
    resumed = len(progress.windows)
    for index in range(resumed, len(windows)):
        window = windows[index]
        ref = reference_window(logits_fn(window), window, seed=index, first=first)
        check_finite("the reference's", index, negative_log_likelihood=ref.nll, top_log_probability=ref.top_logp[:, 0])
        progress.add({name: getattr(ref, name) for name in REFERENCE_FIELDS})
        if on_window:
            on_window(index + 1)
    refs = [ReferenceWindow(**w) for w in progress.windows]
    seconds = time.perf_counter() - started
    summary = summarize(np.concatenate([r.nll for r in refs]))
    summary.update(_timing(seconds, windows, resumed))
    progress.finish()
    return refs, summary


def score_artifact(
    logits_fn: Callable[[np.ndarray], LogitRows],
    windows: np.ndarray,
    refs: list[ReferenceWindow],
    on_window: Callable[[int], None] | None = None,
    progress_path: Path | None = None,
    first: int = 0,
) -> dict:
    """An artifact's figures against the reference's (``refs``, made with the same ``first``)."""
    started = time.perf_counter()
    progress = WindowProgress(progress_path)
    resumed = len(progress.windows)
    for index in range(resumed, len(windows)):
        compared = compare_window(logits_fn(windows[index]), windows[index], refs[index], first=first)
        check_finite("the artifact's", index, negative_log_likelihood=compared["nll"], kl_divergence=compared["kld"])
        progress.add(compared)
        if on_window:
            on_window(index + 1)
    seconds = time.perf_counter() - started
    summary = summarize(*(np.concatenate([w[key] for w in progress.windows]) for key in ("nll", "kld", "agree")))
    summary.update(_timing(seconds, windows, resumed))
    # per-window sums beside the reference's, for the card's paired intervals (uncertainty.py)
    summary["per_window"] = window_sums(
        [w["nll"] for w in progress.windows],
        [r.nll for r in refs],
        [w["kld"] for w in progress.windows],
        [w["agree"] for w in progress.windows],
    )
    progress.finish()
    return summary

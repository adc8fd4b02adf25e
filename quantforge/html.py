"""card.html: the card's tables as HTML, with two plots (matplotlib, written as PNG files beside it).

- card-quality.png: quality loss (mean KL divergence) against artifact size, the Pareto front marked: the formats
  for which no other format is both smaller and closer to the reference.
- card-speed.png: measured decode speed on this host against the memory-bandwidth bound of each format.
- card-search.png (a run with gguf-auto): every candidate of the search by size and KL divergence, the confirmed
  ones and the chosen file, beside the run's other GGUF files.
"""

from __future__ import annotations

import html
from pathlib import Path

from .fsutil import atomic_output, atomic_write_text
from .rundir import CARD_HTML

QUALITY_PNG = "card-quality.png"
SPEED_PNG = "card-speed.png"
SEARCH_PNG = "card-search.png"


def _save(figure, path: Path) -> None:
    with atomic_output(path) as tmp:
        figure.savefig(tmp, format="png", dpi=110, bbox_inches="tight")


def plot_quality(card: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [
        (e["key"], e["size_bytes"] / 1e6, e["metrics"]["kld_mean"])
        for e in card["formats"]
        if e.get("complete") and e["metrics"].get("kld_mean") is not None
    ]
    front = card.get("pareto_front") or []
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for key, size, loss in points:
        on_front = key in front
        axes.scatter(size, loss, s=60, color="tab:red" if on_front else "tab:blue", zorder=3)
        axes.annotate(key, (size, loss), textcoords="offset points", xytext=(6, 4), fontsize=8)
    ordered = sorted((p for p in points if p[0] in front), key=lambda p: p[1])
    if len(ordered) > 1:
        axes.plot(
            [p[1] for p in ordered], [p[2] for p in ordered], color="tab:red", linestyle="--", label="Pareto front"
        )
        axes.legend()
    axes.set_xlabel("artifact size (MB)")
    axes.set_ylabel("mean KL divergence vs reference")
    axes.set_title(f"{card['model']['name']}: quality loss against size")
    axes.grid(alpha=0.3)
    if points and min(p[2] for p in points) > 0:
        axes.set_yscale("log")
    _save(figure, path)
    plt.close(figure)


def plot_search(card: dict, path: Path) -> bool:
    """gguf-auto's candidates (KL on the search's first windows), its confirmations and choice (on every window),
    and the run's other GGUF files (every window). False when the run has no search."""
    searched = [e for e in card["formats"] if (e.get("quantize") or {}).get("search")]
    if not searched:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for entry in searched:
        search = entry["quantize"]["search"]
        few = [c for c in search["candidates"] if c["windows"] == search["sensitivity_windows"]]
        axes.scatter(
            [c["size_bytes"] / 1e6 for c in few], [c["kld_mean"] for c in few], s=14, color="tab:gray",
            label=f"candidates (first {search['sensitivity_windows']} windows)",
        )  # fmt: skip
        confirmed = search["confirmed"]
        axes.scatter(
            [c["size_bytes"] / 1e6 for c in confirmed], [c["kld_mean"] for c in confirmed], s=40,
            color="tab:orange", label=f"confirmed ({search['windows']} windows)", zorder=3,
        )  # fmt: skip
        if search.get("target_kld") is not None:
            axes.axhline(search["target_kld"], color="tab:red", linestyle=":", label="--max-kld")
    uniform = [
        e
        for e in card["formats"]
        if e.get("complete") and e.get("family") == "gguf" and e.get("metrics", {}).get("kld_mean")
    ]
    for entry in uniform:
        size, loss = entry["size_bytes"] / 1e6, entry["metrics"]["kld_mean"]
        axes.scatter(size, loss, s=50, color="tab:blue", marker="D", zorder=4)
        axes.annotate(entry["key"], (size, loss), textcoords="offset points", xytext=(6, 4), fontsize=8)
    axes.set_xlabel("file size (MB)")
    axes.set_ylabel("mean KL divergence vs reference")
    axes.set_title(f"{card['model']['name']}: gguf-auto's search")
    axes.set_yscale("log")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    _save(figure, path)
    plt.close(figure)
    return True


def plot_speed(card: dict, path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [("reference", card["reference"].get("speed"))] + [(e["key"], e.get("speed")) for e in card["formats"]]
    rows = [(key, speed) for key, speed in rows if speed]
    if not rows:
        return False
    figure, axes = plt.subplots(figsize=(7, 4.5))
    positions = range(len(rows))
    # the bound of the device each ran on (cards before the device had the host's only)
    bounds = [speed.get("decode_tps_bound", speed["host_decode_tps_bound"]) or 0 for _, speed in rows]
    measured = [speed["decode_tps"] if speed.get("measured") else 0 for _, speed in rows]
    axes.bar([p - 0.2 for p in positions], bounds, width=0.4, color="lightgray", label="bandwidth bound (computed)")
    axes.bar([p + 0.2 for p in positions], measured, width=0.4, color="tab:green", label="measured decode")
    for position, (_, speed) in zip(positions, rows, strict=True):
        if not speed.get("measured"):
            axes.annotate("not measured", (position + 0.2, 0), rotation=90, fontsize=7, ha="center", va="bottom")
    axes.set_xticks(list(positions), [key for key, _ in rows], rotation=30, ha="right", fontsize=8)
    axes.set_ylabel("tokens per second")
    axes.set_title("decode speed on this host against the memory-bandwidth roofline")
    axes.legend()
    axes.grid(axis="y", alpha=0.3)
    _save(figure, path)
    plt.close(figure)
    return True


def _markdown_tables_to_html(markdown: str) -> str:
    """The card's Markdown (headings, paragraphs, bullet lists, pipe tables) as simple HTML."""
    out, table, items = [], [], []

    def flush():
        if table:
            head, *body = [row for row in table if not set(row.replace("|", "").strip()) <= {"-", ""}]
            cells = lambda row: [c.strip() for c in row.strip().strip("|").split("|")]  # noqa: E731
            out.append(
                "<table><thead><tr>"
                + "".join(f"<th>{_inline(c)}</th>" for c in cells(head))
                + "</tr></thead><tbody>"
                + "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in cells(r)) + "</tr>" for r in body)
                + "</tbody></table>"
            )
            table.clear()
        if items:
            out.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in items) + "</ul>")
            items.clear()

    for line in markdown.splitlines():
        if line.startswith("|"):
            table.append(line)
            continue
        if line.startswith("- "):
            items.append(line[2:])
            continue
        flush()
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            out.append(f"<h{level}>{_inline(line.lstrip('#').strip())}</h{level}>")
        elif line.strip():
            out.append(f"<p>{_inline(line)}</p>")
    flush()
    return "\n".join(out)


def _inline(text: str) -> str:
    import re

    escaped = html.escape(text)
    escaped = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", escaped)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", escaped)


STYLE = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:0.9em}th,td{border:1px solid #ccc;padding:4px 8px}
th{background:#f3f3f3}img{max-width:100%;margin:1em 0}code{background:#f3f3f3;padding:0 3px}"""


def write_html(run_dir: Path, card: dict) -> None:
    from .markdown import render_markdown

    plot_quality(card, run_dir / QUALITY_PNG)
    has_speed = plot_speed(card, run_dir / SPEED_PNG)
    front = card.get("pareto_front") or []
    body = _markdown_tables_to_html(render_markdown(card))
    figures = [
        f'<h2>Quality against size</h2><img src="{QUALITY_PNG}" alt="quality loss against size">'
        f"<p>Pareto front (no other format is both smaller and closer): {html.escape(', '.join(front))}.</p>"
    ]
    if has_speed:
        figures.append(f'<h2>Speed against the roofline</h2><img src="{SPEED_PNG}" alt="decode speed and roofline">')
    if plot_search(card, run_dir / SEARCH_PNG):
        figures.append(f'<h2>gguf-auto: the search</h2><img src="{SEARCH_PNG}" alt="candidates by size and KL">')
    page = (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>quantforge card: '
        f"{html.escape(card['model']['name'])}</title><style>{STYLE}</style></head><body>\n{body}\n"
        + "\n".join(figures)
        + "\n</body></html>\n"
    )
    atomic_write_text(run_dir / CARD_HTML, page)

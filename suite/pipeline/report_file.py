"""The pipeline's report: <dir>/report.md (every stage, and a table of the figures of each model the
pipeline made) and <dir>/report.png (one figure, four bar charts: accuracy, perplexity, size, decode
tokens/s per stage). Matplotlib on the Agg backend: no display needed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from suite.pipeline.recipe import Pipeline
from suite.verb import VERBS

PANELS = (
    ("accuracy", "task accuracy (exact match)", 1.0),
    ("perplexity", "perplexity (lower is better)", 1.0),
    ("bytes", "size (MB of weights)", 1e-6),
    ("decode_tokens_per_s", "decode tokens/s", 1.0),
)


def _cell(value: Any, metric: str) -> str:
    if value is None:
        return ""
    if metric == "accuracy":
        return f"{value:.1%}"
    if metric in ("params", "bytes"):
        return f"{int(value):,}"
    return f"{value:,.3g}" if value < 100 else f"{value:,.0f}"


def write_report(
    pipeline: Pipeline,
    records: dict[str, dict[str, Any]],
    figures: dict[str, dict[str, Any]],
    gates: list[dict[str, Any]],
    status: str,
) -> list[Path]:
    out = pipeline.dir
    lines = [
        f"# Pipeline {pipeline.name}",
        "",
        f"Recipe `{pipeline.recipe}`, folder `{out}`; status: **{status}**.",
        "",
        "| stage | verb | this run | seconds | accuracy | perplexity | parameters | size (bytes) | decode tokens/s |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, rec in records.items():
        row = figures.get(name, {})
        measured = rec["needs"][0] if VERBS[rec["verb"]].stage_output == "result" and rec["needs"] else None
        cells = [
            _cell(row.get(m), m) for m in ("accuracy", "perplexity", "params", "bytes", "decode_tokens_per_s")
        ]
        if measured:
            cells = [f"(of {measured})", "", "", "", ""]
        seconds = rec.get("seconds")
        lines.append(
            f"| {name} | {rec['verb']} | {rec['action']}{'' if rec['status'] in ('done', 'pending') else ' (' + rec['status'] + ')'} "
            f"| {'' if seconds is None else f'{seconds:.0f}'} | " + " | ".join(cells) + " |"
        )
    lines += [
        "",
        "Figures belong to the model a stage made; an eval stage's figures are listed on the stage it",
        "measured. Size: a training stage's fp32 weights, a quantize stage's weights file, an export's",
        "weight files. Quantize reports measure decode speed before and after.",
    ]
    if gates:
        lines += ["", "## Gates", ""]
        for g in gates:
            lines.append(
                f"- {'passed' if g['passed'] else '**failed**'}: {g['name']} ({g['metric']} {g['value']:.4g}"
                + (f" vs {g['reference']:.4g}" if g.get("vs") else "")
                + ")"
            )
    lines += ["", "![stages](report.png)", ""]
    (out / "report.md").write_text("\n".join(lines))
    png = out / "report.png"
    _plot(figures, [n for n in records if n in figures], png, pipeline.name)
    return [out / "report.md", png]


def _plot(figures: dict[str, dict[str, Any]], order: list[str], path: Path, title: str) -> None:
    # deferred: matplotlib (~0.5 s) loads only when the figure is drawn (suite --help imports suite.pipeline),
    # and pyplot must come after matplotlib.use('Agg')
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: as above, and only after use("Agg")

    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 4.2))
    colors = plt.get_cmap("tab10").colors
    for ax, (metric, label, scale) in zip(axes, PANELS):
        names = [n for n in order if figures[n].get(metric) is not None]
        values = [figures[n][metric] * scale for n in names]
        ax.set_title(label, fontsize=10)
        if not names:
            ax.text(0.5, 0.5, "no stage measured this", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            continue
        bars = ax.bar(names, values, color=[colors[order.index(n) % len(colors)] for n in names])
        ax.bar_label(bars, labels=[f"{v:.3g}" for v in values], fontsize=8)
        ax.tick_params(axis="x", labelrotation=45, labelsize=8)
        ax.margins(y=0.15)
        if metric == "accuracy":
            ax.set_ylim(0, 1.1)
    fig.suptitle(f"pipeline {title}: every stage's model")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)

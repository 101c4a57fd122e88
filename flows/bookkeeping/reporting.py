"""What a person looks at in the Prefect UI and the run directory: metrics tables and
reward/loss curves, for the whole run and for each rollout step.

Artifact keys start with the run's name (`arithmetic-grpo-step-metrics`), so trainings that
share a Prefect server keep their own history. The curves go to the UI as a markdown
artifact with the PNG inlined as a data URI: an image artifact can only link to a URL, and a
browser refuses the `file://` one of a local run directory.
"""

from __future__ import annotations

import base64
from typing import Any

from prefect.artifacts import create_markdown_artifact, create_table_artifact

from storage.run_layout import RunLayout
from tasks.artifact_sender import send_artifact
from tasks.artifacts import artifact_key, for_people, rounded_rows

CURVES = ("reward/mean", "train/loss", "train/approx_kl", "rollout/response_len_mean")


def collect_metrics(layout: RunLayout) -> list[dict[str, Any]]:
    return [layout.step_metrics(k) for k in layout.committed_steps()]


def run_name_of(layout: RunLayout) -> str:
    """The run's name: the last part of its directory (`RunLayout.open` puts it there)."""
    return layout.uri.rstrip("/").rsplit("/", 1)[-1]


PLOT_DPI = 90


def plot_curves(
    rows: list[dict[str, Any]], evals: dict[int, dict[str, Any]], dpi: int = PLOT_DPI
) -> bytes:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in CURVES if any(k in r for r in rows)]
    eval_keys = sorted({k for e in evals.values() for k in e if k.count("/") == 1})
    panels = keys + eval_keys
    # At most three panels a row: one row of five is too flat to read in the UI's column.
    cols = min(max(len(panels), 1), 3)
    rows_n = -(-max(len(panels), 1) // cols)
    fig, grid = plt.subplots(rows_n, cols, figsize=(4 * cols, 3.2 * rows_n), squeeze=False)
    axes = list(grid.flat)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    for ax, key in zip(axes, panels, strict=False):
        if key in eval_keys:
            xs = sorted(evals)
            ax.plot(xs, [evals[x].get(key, float("nan")) for x in xs], marker="o")
            ax.set_xlabel("weight version")
        else:
            pts = [(r["rollout_id"], r[key]) for r in rows if key in r]
            ax.plot([p[0] for p in pts], [p[1] for p in pts])
            ax.set_xlabel("rollout step")
        ax.set_title(key)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    return buf.getvalue()


TABLE_COLUMNS = ("rollout_id", *CURVES, "time/generate", "time/train")


def metrics_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The table's columns, floats to 4 significant digits (metrics.json keeps them all)."""
    return rounded_rows([{k: r.get(k) for k in TABLE_COLUMNS if k in r} for r in rows])


def publish_step_table(rows: list[dict[str, Any]], key: str, description: str = "") -> None:
    if rows:
        send_artifact(create_table_artifact, metrics_table(rows), key=artifact_key(key),
                      description=description)


def eval_history(evals: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per evaluated weight version, one column per held-out metric."""
    return [{"weight_version": v, **{k: for_people(x) for k, x in sorted(evals[v].items())
                                     if isinstance(x, int | float) and not isinstance(x, bool)}}
            for v in sorted(evals)]


# Inlined in the markdown artifact: 2/3 of the file's size, and with 32 colours (line plots
# need no more) about 20 KB instead of 60-130 KB per step's flow run. Scaled from the file's
# image, not drawn again: a matplotlib draw is the dearest part of a plotted step
# (bench/RESULTS.md, "Orchestration").
UI_PLOT_SCALE = 60 / PLOT_DPI


def small_png(png: bytes, colors: int = 32, scale: float = 1.0) -> bytes:
    import io

    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    if scale != 1.0:
        size = (round(image.width * scale), round(image.height * scale))
        image = image.resize(size, Image.Resampling.LANCZOS)
    out = io.BytesIO()
    image.quantize(colors=colors).save(out, format="PNG", optimize=True)
    return out.getvalue()


def curves_markdown(png: bytes, where: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f"![reward and loss curves](data:image/png;base64,{data})\n\nFull size: `{where}`\n"


def _publish_curves(layout: RunLayout, rows: list[dict[str, Any]], evals: Any) -> str:
    png = plot_curves(rows, evals)
    uri = layout.store.write_bytes(png, "curves.png")
    send_artifact(
        create_markdown_artifact,
        curves_markdown(small_png(png, scale=UI_PLOT_SCALE), uri),
        key=artifact_key(run_name_of(layout), "reward-curves"),
        description=f"reward and loss up to step {rows[-1]['rollout_id'] if rows else 0}",
    )
    return uri


def publish_step_report(
    layout: RunLayout, rollout_id: int, metrics: dict[str, Any], make_plot: bool = True
) -> None:
    """Artifacts of one rollout step (on its flow run, or the train run): every scalar metric
    of the step (table `{run}-step-metrics`) and the curves up to this step (markdown
    `{run}-reward-curves`)."""
    table = [
        {"metric": k, "value": for_people(v)}
        for k, v in sorted(metrics.items())
        if isinstance(v, int | float) and not isinstance(v, bool)
    ]
    send_artifact(create_table_artifact, table,
                  key=artifact_key(run_name_of(layout), "step-metrics"),
                  description=f"step {rollout_id} of {layout.uri}")
    if make_plot:
        _publish_curves(layout, collect_metrics(layout), layout.evals())


def publish_run_report(layout: RunLayout, make_plot: bool = True) -> dict[str, Any]:
    """Write curves.png to the run directory and show the tables (per step; held-out
    metrics per weight version) and the plot in Prefect."""
    rows = collect_metrics(layout)
    evals = layout.evals()
    report: dict[str, Any] = {"steps": len(rows), "evals": evals}
    run = run_name_of(layout)
    publish_step_table(rows, key=f"{run}-run-metrics", description=f"metrics of {layout.uri}")
    if evals:
        send_artifact(create_table_artifact, eval_history(evals),
                      key=artifact_key(run, "eval-history"),
                      description=f"held-out metrics of {run} per weight version")
    if make_plot and rows:
        report["plot"] = _publish_curves(layout, rows, evals)
    return report

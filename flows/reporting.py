"""What a person looks at in the Prefect UI and the run directory: metrics tables and
reward/loss curves, for the whole run and for each rollout step's flow run."""

from __future__ import annotations

from typing import Any

from prefect.artifacts import create_image_artifact, create_table_artifact

from storage.run_layout import RunLayout
from tasks.artifacts import artifact_key

CURVES = ("reward/mean", "train/loss", "train/approx_kl", "rollout/response_len_mean")


def collect_metrics(layout: RunLayout) -> list[dict[str, Any]]:
    return [layout.step_metrics(k) for k in layout.committed_steps()]


def plot_curves(rows: list[dict[str, Any]], evals: dict[int, dict[str, Any]]) -> bytes:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in CURVES if any(k in r for r in rows)]
    eval_keys = sorted({k for e in evals.values() for k in e if k.count("/") == 1})
    panels = keys + eval_keys
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(4 * max(len(panels), 1), 3.2))
    axes = axes if hasattr(axes, "__len__") else [axes]
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
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


TABLE_COLUMNS = ("rollout_id", *CURVES, "time/generate", "time/train")


def metrics_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: r.get(k) for k in TABLE_COLUMNS if k in r} for r in rows]


def publish_step_table(rows: list[dict[str, Any]], key: str, description: str = "") -> None:
    if rows:
        create_table_artifact(metrics_table(rows), key=artifact_key(key), description=description)


def _publish_curves(layout: RunLayout, rows: list[dict[str, Any]], evals: Any) -> str:
    uri = layout.store.write_bytes(plot_curves(rows, evals), "curves.png")
    image_url = uri if "://" in uri else f"file://{uri}"
    create_image_artifact(image_url, key="reward-curves", description="reward and loss")
    return uri


def publish_step_report(
    layout: RunLayout, rollout_id: int, metrics: dict[str, Any], make_plot: bool = True
) -> None:
    """Artifacts of one rollout step's flow run: every scalar metric of the step (table
    `step-metrics`) and the curves up to this step (image `reward-curves`)."""
    table = [
        {"metric": k, "value": v}
        for k, v in sorted(metrics.items())
        if isinstance(v, int | float) and not isinstance(v, bool)
    ]
    create_table_artifact(table, key="step-metrics", description=f"step {rollout_id} of {layout.uri}")
    if make_plot:
        _publish_curves(layout, collect_metrics(layout), layout.evals())


def publish_run_report(layout: RunLayout, make_plot: bool = True) -> dict[str, Any]:
    """Write curves.png to the run directory and show the table and plot in Prefect."""
    rows = collect_metrics(layout)
    evals = layout.evals()
    report: dict[str, Any] = {"steps": len(rows), "evals": evals}
    publish_step_table(rows, key="run-metrics", description=f"metrics of {layout.uri}")
    if make_plot and rows:
        report["plot"] = _publish_curves(layout, rows, evals)
    return report

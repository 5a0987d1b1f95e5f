"""PNG plots of a ``dpd bench run`` results file: SLO attainment vs rate per scenario, TTFT and
ITL CDFs per request class at the same offered load (the comparison run, else each scenario's
highest rate), latency over time, and goodput vs threshold when a sweep was run.

Rendered with matplotlib's non-interactive Agg backend from ``results.json`` alone, so plots can
be redrawn without rerunning anything: ``dpd bench plot RESULTS_DIR``.
"""

from __future__ import annotations

import json
from pathlib import Path


def _cdf(ax, values: list[float], label: str) -> None:
    values = sorted(v for v in values if v == v)
    if values:
        ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=label)


def plot(results_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = json.loads((results_dir / "results.json").read_text())
    scenarios = results["scenarios"]
    written: list[Path] = []

    fig, ax = plt.subplots(figsize=(6, 4))
    styles = [("o", "-"), ("s", "--"), ("^", "-."), ("D", ":")]
    for (name, sc), (marker, line) in zip(scenarios.items(), styles * 4):
        entries = sorted(sc["rates"], key=lambda e: e["rate_rps"])
        # Scenarios often tie; distinct markers and dashes keep every one visible.
        ax.plot([e["rate_rps"] for e in entries], [e["all"]["slo_attainment"] for e in entries], marker=marker, linestyle=line,
                markersize=9 - 1.5 * styles.index((marker, line)), label=name)
    ax.axhline(0.9, color="grey", linestyle="--", linewidth=0.8)
    ax.set(xlabel="offered load (req/s)", ylabel="SLO attainment", title="SLO attainment vs rate", ylim=(0, 1.05))
    ax.legend()
    written.append(_save(fig, results_dir / "attainment.png"))

    for metric, label in (("ttft_s", "TTFT (s)"), ("itls_s", "inter-token latency (s)")):
        fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
        for ax, request_class in zip(axes, ("short", "long")):
            for name, sc in scenarios.items():
                top = _reference(sc)
                records = [r for r in top["records"] if r["request_class"] == request_class and r["is_ok"]]
                values = [g for r in records for g in r["itls_s"]] if metric == "itls_s" else [r["ttft_s"] for r in records]
                _cdf(ax, values, name)
            ax.set(xlabel=label, title=f"{request_class} requests @ {_reference(sc)['rate_rps']:g} req/s")
            ax.set_xscale("log")
        axes[0].set_ylabel("CDF")
        axes[0].legend()
        written.append(_save(fig, results_dir / f"{'ttft' if metric == 'ttft_s' else 'itl'}_cdf.png"))

    fig, ax = plt.subplots(figsize=(8, 4))
    for name, sc in scenarios.items():
        top = _reference(sc)
        ok = [r for r in top["records"] if r["is_ok"]]
        ax.plot(range(len(ok)), [r["e2e_s"] for r in ok], marker=".", label=f"{name} @ {top['rate_rps']:g}")
    ax.set(xlabel="request (arrival order)", ylabel="E2E latency (s)", title="latency over the run (same offered load)")
    ax.legend()
    written.append(_save(fig, results_dir / "latency_over_time.png"))

    if results.get("sweep"):
        sweep = sorted(results["sweep"], key=lambda e: e["threshold_tokens"])
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [e["threshold_tokens"] for e in sweep]
        ax.plot(xs, [e["all"]["goodput_rps"] for e in sweep], marker="o", label="goodput")
        ax.set(xlabel="routing threshold (prompt tokens)", ylabel="goodput (req/s)",
               title=f"goodput vs threshold @ {sweep[0]['rate_rps']:g} req/s")
        ax2 = ax.twinx()
        ax2.plot(xs, [e["by_class"].get("short", {}).get("itl_p99_s", float("nan")) * 1000 for e in sweep],
                 marker="s", linestyle="--", color="tab:red", label="P99 ITL short (ms)")
        ax2.set_ylabel("P99 ITL of short requests (ms)")
        ax.set_xscale("symlog", linthresh=256)
        fig.legend(loc="upper right")
        written.append(_save(fig, results_dir / "sweep.png"))
    return written


def _reference(sc: dict) -> dict:
    """The run to draw distributions from: the same-load comparison, else the highest rate."""
    compare = [e for e in sc["rates"] if e.get("purpose") == "compare"]
    return compare[0] if compare else max(sc["rates"], key=lambda e: e["rate_rps"])


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path

"""The per-policy comparison as a PNG: fresh prefill against the bounds, and TTFT tails.

matplotlib is optional: without it `plot_report` writes nothing and returns None.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def plot_report(report: Mapping[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib  # type: ignore[import-not-found,unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    policies: Mapping[str, Mapping[str, Any]] = report.get("policies", {})
    if not policies:
        return None
    names = list(policies)
    x = range(len(names))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    fresh = [policies[n]["fresh_prefill_tokens"] / 1e6 for n in names]
    ax1.bar(x, fresh, color="#4c72b0")
    styles = {"no_cache": ("#c44e52", "--"), "unbounded": ("#55a868", ":"), "optimal": ("k", "-")}
    for name, b in report.get("bounds", {}).items():
        color, style = styles.get(name, ("grey", "-."))
        label = f"{name.replace('_', ' ')} {b['fresh_prefill_tokens'] / 1e6:.1f}"
        ax1.axhline(b["fresh_prefill_tokens"] / 1e6, color=color, ls=style, lw=1.2, label=label)
    ax1.set_ylabel("fresh prefill (M tokens)")
    ax1.set_title("Prefill work (lower is better)")
    if report.get("bounds"):
        ax1.legend(fontsize=8, loc="lower right")
    width = 0.27
    top = 0.0
    for k, (key, color) in enumerate(
        (("ttft_p50_s", "#8172b2"), ("ttft_p95_s", "#ccb974"), ("ttft_p99_s", "#64b5cd"))
    ):
        vals = [policies[n].get(key) or 0.0 for n in names]
        top = max(top, *vals)
        ax2.bar([i + (k - 1) * width for i in x], vals, width, color=color, label=key[5:8])
    ax2.set_yscale("log")
    if top > 0:
        ax2.set_ylim(top=top * 4)
    ax2.set_ylabel("time to first token (s)")
    ax2.set_title("TTFT p50 / p95 / p99 (lower is better)")
    ax2.legend(fontsize=8, ncol=3, loc="upper center")
    for ax in (ax1, ax2):
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    trace = report.get("trace", {})
    setup = report.get("setup", {})
    fig.suptitle(
        f"{Path(str(trace.get('path', ''))).name}: {trace.get('requests')} requests on "
        f"{setup.get('workers')} workers, {setup.get('kv_gib_per_worker')} GiB KV each",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

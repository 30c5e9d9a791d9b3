"""A training step's memory drawn with matplotlib: the plan's prediction against the allocator.

:func:`plot_timeline` draws an :class:`exec.timeline.Timeline` (one point per operation of the
schedule, forward then backward): the predicted memory, the memory the allocator measured
while the operation ran, the budget, and the operation where the measured peak is. Used by
``Rockmate.plot_memory`` and ``benchmarks/plot_memory.py``.
"""

from __future__ import annotations

from pathlib import Path

from exec.timeline import Timeline

__all__ = ["plot_timeline"]


def _mib(value: int) -> float:
    return value / 2**20


def plot_timeline(timeline: Timeline, path, budget: int | None = None, title: str = "") -> Path:
    """Write the plot of ``timeline`` to ``path`` (any format matplotlib writes: .png, .svg,
    .pdf) and return the path. Needs matplotlib (``pip install matplotlib``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:  # a clear message rather than a bare ImportError deep inside
        raise ImportError("plotting the memory needs matplotlib: pip install matplotlib") from error
    steps = list(range(len(timeline.labels)))
    measured = [(i, m) for i, m in zip(steps, timeline.measured) if m is not None]
    figure, axes = plt.subplots(figsize=(10, 4.5))
    axes.step(steps, [_mib(p) for p in timeline.predicted], where="mid", label="predicted (plan)")
    axes.plot([i for i, _ in measured], [_mib(m) for _, m in measured], ".", markersize=4,
              label="measured (allocator)")
    if budget is not None:
        axes.axhline(_mib(budget), color="red", linestyle="--", linewidth=1, label="budget")
    if measured:
        index, label = timeline.peak_operation()
        axes.annotate(f"peak: {label}", (index, _mib(timeline.measured[index])), textcoords="offset points",
                      xytext=(5, 8), fontsize=8)
    backward = next((i for i, label in enumerate(timeline.labels) if "bwd_" in label), None)
    if backward is not None:
        axes.axvline(backward - 0.5, color="grey", linewidth=0.8)
        axes.text(backward, axes.get_ylim()[1] * 0.02, " backward", color="grey", fontsize=8)
    axes.set_xlabel("operation of the schedule")
    axes.set_ylabel("memory above the step's start (MiB)")
    axes.set_title(title or f"measured peak {_mib(timeline.measured_peak):.2f} MiB, "
                            f"predicted {_mib(timeline.predicted_peak):.2f} MiB")
    axes.legend(loc="upper left", fontsize=8)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path

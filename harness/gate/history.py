"""History: the gated metrics as a benchmark feed, and a metric plotted across a run sequence.

`benchmark_entries` turns summaries into github-action-benchmark's `customSmallerIsBetter`
format (a JSON list of `{name, unit, value, extra}`), which github-action-benchmark and Bencher
keep as history charts. `write_history` plots chosen metrics across a sequence of report or
baselines folders (baselines, then tonight's reports, ...): one PNG per scenario, one line per
variant, a gap where a variant is absent from a run or did not complete.

Nothing here imports MLX or mlx-lm. matplotlib is imported only when a plot is drawn, so the
export stays as light as the rest of the gate.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..common.echo import echo
from ..common.files import atomic_write
from ..common.units import MiB
from ..judge.metrics import METRICS, RATIO, gated
from ..judge.summary import Summary
from ..store.summaries import summaries_under
from .baseline import unsafe_name
from .compare import Key, index_summaries
from .tolerance import CompareError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DEFAULT_METRICS = ("peak", "steady")


def benchmark_entries(summaries: Sequence[Summary]) -> list[dict]:
    """github-action-benchmark's `customSmallerIsBetter` entries: one per gated metric of each
    run that completed (a metric without a value, such as overhead_ratio with no analytic
    minimum, is left out). The name carries no backend, so summaries of one backend at a time:
    two summaries of one variant are bad input."""
    by_variant: dict[tuple[str, str], Summary] = {}
    entries = []
    for s in summaries:
        if s.key in by_variant:
            raise CompareError(f"two summaries for {s.label}: {by_variant[s.key].path} and "
                               f"{s.path} (export one backend's summaries at a time)")
        by_variant[s.key] = s
        if not s.ok:
            continue
        env = s.environment
        extra = f"{s.backend}, mlx {env.mlx}, mlx-lm {env.mlx_lm}"
        for metric in gated():
            value = s.metric(metric)
            if value is not None:
                # The quantity's unit, a rate's too (`bytes` where the nightly record says
                # `bytes/req`), as the feeds already published hold it.
                entries.append({"name": f"{s.label} {metric}", "unit": METRICS[metric].unit,
                                "value": value, "extra": extra})
    return entries


def render_benchmark(summaries: Sequence[Summary]) -> str:
    return json.dumps(benchmark_entries(summaries), indent=2) + "\n"


# `kvmem export --format`: the one feed format, rendered by `render_benchmark`.
FEED = "github-action-benchmark"


@dataclass(frozen=True)
class Point:
    """One point on the history's x axis: a report or baselines folder."""

    label: str
    summaries: dict[Key, Summary]

    def value(self, key: Key, metric: str) -> float:
        """The metric of a completed run of `key`, else NaN: matplotlib draws NaN as a gap."""
        summary = self.summaries.get(key)
        value = summary.metric(metric) if summary is not None and summary.ok else None
        return math.nan if value is None else value


def points(paths: Sequence[str | Path]) -> list[Point]:
    """Each folder as a point, in the order given, labelled by the git revision its summaries
    share (the folder's name when they share none); a label given twice names its folder too."""
    runs = []
    for path in paths:
        summaries = summaries_under(path)
        revisions = {s.environment.git_revision for s in summaries}
        revision = revisions.pop() if len(revisions) == 1 else None
        name = Path(path).resolve().name or str(path)
        label = revision if isinstance(revision, str) and revision else name
        runs.append((label, name, index_summaries(summaries, str(path))))
    labels = [label for label, _, _ in runs]
    return [Point(label if labels.count(label) == 1 or label == name else f"{label} ({name})",
                index) for label, name, index in runs]


def _lines(runs: Sequence[Point], scenario: str) -> list[Key]:
    return sorted({key for run in runs for key in run.summaries if key[0] == scenario},
                  key=lambda k: (k[1], k[2]))


def scenarios(runs: Sequence[Point]) -> list[str]:
    return sorted({key[0] for run in runs for key in run.summaries})


def history_figure(runs: Sequence[Point], scenario: str, metrics: Sequence[str]) -> Figure:
    """One axis per metric, one line per variant (and backend, where runs hold several), one
    point per run; a run where the variant is absent or failed is a gap."""
    from matplotlib.figure import Figure

    keys = _lines(runs, scenario)
    several_backends = len({key[2] for run in runs for key in run.summaries}) > 1
    fig = Figure(figsize=(11, 1.5 + 3.5 * len(metrics)))
    axes = fig.subplots(len(metrics), 1, sharex=True, squeeze=False)[:, 0]
    x = list(range(len(runs)))
    for ax, metric in zip(axes, metrics, strict=True):
        ratio = METRICS[metric].unit == RATIO
        scale = 1 if ratio else MiB
        for key in keys:
            label = f"{key[1]} ({key[2]})" if several_backends else key[1]
            ax.plot(x, [run.value(key, metric) / scale for run in runs], marker="o",
                    markersize=4, label=label)
        ax.set_ylabel(f"{metric} ({'ratio' if ratio else 'MiB'})")
        ax.grid(alpha=0.3)
    axes[0].set_title(f"{scenario}: {', '.join(metrics)} per run (a gap: absent or failed)")
    axes[0].legend(loc="upper left", fontsize=8)
    axes[-1].set_xticks(x, [run.label for run in runs], rotation=30, ha="right")
    axes[-1].set_xlabel("run")
    axes[-1].set_xlim(-0.5, len(runs) - 0.5)
    fig.tight_layout()
    return fig


def write_history(runs: Sequence[Point], out: Path, metrics: Sequence[str]) -> list[Path]:
    """`<out>/<scenario>.png` for each scenario in any run, each written atomically (Agg)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    names = scenarios(runs)
    for name in names:
        reason = unsafe_name(name)
        if reason:
            raise CompareError(f"scenario {echo(name)} {reason}: it must be one plain name to "
                               "name its plot")
    written = []
    for name in names:
        canvas = FigureCanvasAgg(history_figure(runs, name, metrics))
        path = out / f"{name}.png"

        def save(tmp: Path, canvas: FigureCanvasAgg = canvas) -> None:
            canvas.figure.savefig(tmp, format="png", dpi=110)

        atomic_write(path, save)
        written.append(path)
    return written

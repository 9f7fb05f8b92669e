"""The history site: the record's runs as a static page, ready for GitHub Pages.

`write_site` writes three files into one folder: `history.json` (the record, which the next
night appends to), `benchmark.json` (the night's github-action-benchmark feed) and
`index.html`. Per scenario the page has a table of each variant's metrics (the latest value, its
change since the previous run, and a sparkline from zero), then, per variant, one chart per
metric: the runs' dates (UTC) on the x axis, the metric in its unit on the y axis, from zero, so
a change reads at its true size. Every point names its date, commit and value (an SVG `<title>`,
shown on hover), and a table lists every run's commit and versions.

The page is plain HTML with inline SVG and no script, so it works offline and on GitHub Pages;
every name that comes from a summary is escaped. matplotlib's tick locator picks round ticks,
imported only when a page is drawn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from html import escape
from pathlib import Path
from string import Template

from ..common.files import atomic_text
from ..common.units import binary_unit
from ..judge.metrics import METRICS, RATIO, gated
from ..judge.summary import Summary
from .history import render_benchmark
from .nightly import Night, Record, VariantNight

# A chart's size and margins, in pixels: room for `1000 MiB/req` left of the axis and a date
# under each end of it.
WIDTH, HEIGHT, LEFT, RIGHT, TOP, BOTTOM, PAD = 300, 170, 70, 14, 24, 34, 8
SPARK_WIDTH, SPARK_HEIGHT = 120, 24
MARK_GAP = 4  # pixels between two markers of one line, at least
DAY = "%Y-%m-%d"
MOMENT = "%Y-%m-%d %H:%M UTC"


@dataclass(frozen=True)
class Scale:
    """A y axis from zero (lower only for a negative value): its ticks, counted in `unit`s of
    `size` (bytes, or 1 for a ratio)."""

    ticks: tuple[float, ...]
    unit: str
    size: float

    def share(self, value: float) -> float:
        """How far up the axis `value` (bytes, ratio) lies, from 0 at its bottom to 1."""
        bottom, top = self.ticks[0] * self.size, self.ticks[-1] * self.size
        return (value - bottom) / (top - bottom)

    def label(self, tick: float) -> str:
        return f"{tick:g} {self.unit}"


def y_scale(metric: str, values: Sequence[float]) -> Scale:
    """Round ticks from zero up to the largest value, in the unit that value reads in (MiB,
    GiB, KiB/req; `×` for a ratio); an axis of zeros goes up to one unit (1 B)."""
    from matplotlib.ticker import MaxNLocator

    spec = METRICS[metric]
    high = max(values, default=0.0)
    if spec.unit == RATIO:
        unit, size = "×", 1
    else:
        unit, size = binary_unit(high)
        unit = spec.suffixed(unit)
    low = min([0.0, *values]) / size
    whole = spec.unit != RATIO and size == 1  # no fraction of a byte
    ticks = MaxNLocator(nbins=4, min_n_ticks=2, integer=whole).tick_values(low, high / size or 1.0)
    return Scale(tuple(round(float(t), 9) for t in ticks), unit, size)


@dataclass(frozen=True)
class TimeAxis:
    """The runs' dates across a chart's width: the first run at the left, the last at the
    right (one run: the middle)."""

    first: datetime
    last: datetime

    def x(self, date: datetime, left: float, width: float) -> float:
        span = (self.last - self.first).total_seconds()
        share = (date - self.first).total_seconds() / span if span else 0.5
        return round(left + share * width, 1)

    def labels(self) -> list[tuple[str, float, str]]:
        """Each end's date, where it goes across the width (0 to 1) and its text anchor; one
        date in the middle when the runs share a day."""
        first, last = self.first.strftime(DAY), self.last.strftime(DAY)
        if first == last:
            return [(first, 0.5, "middle")]
        return [(first, 0, "start"), (last, 1, "end")]


CHART = Template("""\
<svg class="chart" viewBox="0 0 $width $height" width="$width" height="$height" role="img" \
aria-label="$label">
<text x="4" y="14" class="name">$metric ($unit)</text>
$grid<line class="axis" x1="$left" y1="$top" x2="$left" y2="$base"/>\
<line class="axis" x1="$left" y1="$base" x2="$right" y2="$base"/>
$dates<text x="$middle" y="$caption" class="caption">date (UTC)</text>
$lines$points</svg>""")


def _line(points: list[tuple[float, float] | None]) -> str:
    """Polylines through the points, broken where a run has none (absent or failed)."""
    runs: list[list[str]] = [[]]
    for point in points:
        if point is None:
            runs.append([])
        else:
            runs[-1].append(f"{point[0]:g},{point[1]:g}")
    return "".join(f'<polyline class="line" points="{" ".join(run)}"/>' for run in runs if run)


def _tip(run: Night, text: str) -> str:
    """A point's tooltip: its run's date and commit (12 digits; the runs table has them all)."""
    return escape(f"{run.date.strftime(MOMENT)} · commit {run.commit[:12]} · {text}")


def _marks(xs: Sequence[float], values: Sequence[float | None]) -> list[int]:
    """The points that have a marker (and a tooltip): where a line starts, moves or ends, at
    most one every MARK_GAP pixels, so a year of nights stays a small page and every change of
    a sparse history names its run's commit."""
    marks: list[int] = []
    for i, value in enumerate(values):
        if value is None:
            continue
        edge = i in (0, len(values) - 1) or values[i - 1] is None or values[i + 1] is None
        moved = values[i - 1] != value and (not marks or xs[i] - xs[marks[-1]] >= MARK_GAP)
        if edge or moved:
            marks.append(i)
    return marks


def chart(runs: Sequence[Night], scenario: str, variant: str, metric: str, axis: TimeAxis) -> str:
    """One metric of one variant across the runs, as an SVG line chart from zero."""
    entries = [run.variant(scenario, variant) for run in runs]
    values = [e.value(metric) if e else None for e in entries]
    scale = y_scale(metric, [v for v in values if v is not None])
    base, plot = HEIGHT - BOTTOM, HEIGHT - BOTTOM - TOP
    width = WIDTH - LEFT - RIGHT - 2 * PAD
    y = lambda value: round(base - scale.share(value) * plot, 1)
    grid = "".join(f'<line class="grid" x1="{LEFT}" y1="{y(t * scale.size)}" x2="{WIDTH - RIGHT}" '
                   f'y2="{y(t * scale.size)}"/><text x="{LEFT - 4}" y="{y(t * scale.size) + 3}" '
                   f'class="tick">{escape(scale.label(t))}</text>\n' for t in scale.ticks)
    dates = "".join(f'<text x="{LEFT + PAD + share * width:g}" y="{base + 13}" '
                    f'text-anchor="{anchor}">{day}</text>' for day, share, anchor in axis.labels())
    xs, spec = [axis.x(run.date, LEFT + PAD, width) for run in runs], METRICS[metric]
    points = [f'<circle cx="{xs[i]:g}" cy="{y(v):g}" r="2.5"><title>{_tip(runs[i], spec.format(v))}'
              f'</title></circle>' for i in _marks(xs, values) if (v := values[i]) is not None]
    points += [f'<path class="failed" d="M{xs[i] - 3:g},{base - 3}l6,6m0,-6l-6,6"><title>'
               f'{_tip(runs[i], f"{e.status}: {e.error}")}</title></path>'
               for i, e in enumerate(entries) if e is not None and e.status != "ok"]
    line = _line([(xs[i], y(v)) if v is not None else None for i, v in enumerate(values)])
    return CHART.substitute(
        width=WIDTH, height=HEIGHT, label=escape(f"{scenario}/{variant} {metric}"), metric=metric,
        unit=escape(scale.unit), grid=grid, left=LEFT, right=WIDTH - RIGHT, top=TOP, base=base,
        dates=dates, middle=(LEFT + WIDTH - RIGHT) // 2, caption=HEIGHT - 6, lines=line,
        points="\n".join(points) + "\n")


def sparkline(runs: Sequence[Night], scenario: str, variant: str, metric: str,
              axis: TimeAxis) -> str:
    """A small line of one metric across the runs, its baseline at zero and a dot on its last
    value."""
    values = [e.value(metric) if (e := run.variant(scenario, variant)) else None for run in runs]
    shown = [v for v in values if v is not None]
    high = max(shown, default=0.0)
    low = SPARK_HEIGHT - 2
    points = [(axis.x(run.date, 2, SPARK_WIDTH - 4), round(low - v / (high or 1) * (low - 2), 1))
              if v is not None else None for run, v in zip(runs, values, strict=True)]
    last = next((p for p in reversed(points) if p is not None), None)
    dot = f'<circle cx="{last[0]:g}" cy="{last[1]:g}" r="1.5"/>' if last else ""
    title = escape(f"{metric} over {len(runs)} runs: {len(shown)} values, the highest "
                   f"{METRICS[metric].format(high)}; the axis starts at zero")
    return (f'<svg class="spark" viewBox="0 0 {SPARK_WIDTH} {SPARK_HEIGHT}" width="{SPARK_WIDTH}" '
            f'height="{SPARK_HEIGHT}" role="img" aria-label="{title}"><title>{title}</title>'
            f'<line class="axis" x1="2" y1="{low}" x2="{SPARK_WIDTH - 2}" y2="{low}"/>'
            f'{_line(points)}{dot}</svg>')


def _latest(entry: VariantNight | None, metric: str) -> str:
    if entry is None:
        return "absent"
    value = entry.value(metric)
    if value is None:
        return f"{entry.status}: {entry.error}" if entry.status != "ok" else "—"
    return METRICS[metric].format(value)


def change(latest: float | None, previous: float | None, metric: str,
           has_previous: bool) -> str:
    """The latest run's value against the previous run's: signed, with a percentage."""
    if latest is None or not has_previous:
        return "—"
    if previous is None:
        return "new"
    delta, spec = latest - previous, METRICS[metric]
    percent = f" ({delta / previous:+.1%})" if previous else ""
    return spec.format(delta, signed=True) + percent


def _metrics(runs: Sequence[Night], scenario: str, variant: str) -> list[str]:
    """The gated metrics this variant has a value for in some run."""
    return [m for m in gated() if any((e := r.variant(scenario, variant)) and e.value(m) is not None
                                      for r in runs)]


def _variant_rows(runs: Sequence[Night], scenario: str, variant: str, axis: TimeAxis) -> str:
    latest = runs[-1].variant(scenario, variant)
    previous = runs[-2].variant(scenario, variant) if len(runs) > 1 else None
    metrics = _metrics(runs, scenario, variant)
    name = escape(variant)
    if not metrics:
        return (f'<tr><td>{name}</td><td>all</td><td>{escape(_latest(latest, "peak"))}</td>'
                "<td>—</td><td>no run completed</td></tr>\n")
    rows = []
    for i, metric in enumerate(metrics):
        head = f'<td rowspan="{len(metrics)}">{name}</td>' if i == 0 else ""
        now = latest.value(metric) if latest else None
        before = previous.value(metric) if previous else None
        rows.append(f"<tr>{head}<td>{metric}</td><td>{escape(_latest(latest, metric))}</td>"
                    f"<td>{escape(change(now, before, metric, len(runs) > 1))}</td>"
                    f"<td>{sparkline(runs, scenario, variant, metric, axis)}</td></tr>\n")
    return "".join(rows)


SECTION = Template("""\
<section id="scenario-$number">
<h2>$scenario</h2>
<table class="summary">
<thead><tr><th>variant</th><th>metric</th><th>latest</th><th>change vs previous run</th>\
<th>history (from zero)</th></tr></thead>
<tbody>
$rows</tbody>
</table>
$charts</section>
""")


def section(runs: Sequence[Night], scenario: str, number: int, axis: TimeAxis) -> str:
    variants = sorted({v for run in runs for v in run.scenarios.get(scenario, {})})
    charts = "".join(
        f'<h3>{escape(scenario)}/{escape(v)}</h3>\n<div class="charts">\n'
        + "".join(chart(runs, scenario, v, m, axis) + "\n" for m in _metrics(runs, scenario, v))
        + "</div>\n" for v in variants)
    return SECTION.substitute(number=number, scenario=escape(scenario), charts=charts,
                              rows="".join(_variant_rows(runs, scenario, v, axis)
                                           for v in variants))


PAGE = Template("""\
<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>kvmem memory history</title>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5rem; color: #222; }
table { border-collapse: collapse; margin: 0.5rem 0 1rem; }
th, td { border: 1px solid #ddd; padding: 2px 8px; text-align: left; vertical-align: middle; }
td:nth-child(n+3) { font-variant-numeric: tabular-nums; }
.charts { display: flex; flex-wrap: wrap; gap: 6px; }
svg text { font-size: 10px; fill: #444; }
svg .name { font-size: 11px; font-weight: 600; }
svg .tick { text-anchor: end; }
svg .caption { text-anchor: middle; fill: #777; }
svg .axis { stroke: #888; }
svg .grid { stroke: #eee; }
svg .line { fill: none; stroke: #1f77b4; stroke-width: 1.5; }
svg circle { fill: #1f77b4; }
svg .failed { stroke: #d62728; stroke-width: 2; }
code { font-size: 13px; }
</style>
</head>
<body>
<h1>kvmem memory history</h1>
<p>$count runs on backend <code>$backend</code>, from $first to $last. The latest: commit
<code>$commit</code>, mlx $mlx, mlx-lm $mlx_lm. Data: <a href="history.json">history.json</a>
(every run), <a href="benchmark.json">benchmark.json</a> (the latest run in
github-action-benchmark's <code>customSmallerIsBetter</code> format).</p>
<p>Every metric is lower-is-better. Each chart has the runs' dates (UTC) on the x axis and the
metric in its unit on the y axis, from zero. A dot marks where a line starts, moves or ends:
hover it for the run's date, commit and value. A gap in a line: the variant was absent from that
run; a red ✕ on the axis: it did not complete. The
change is the latest run's value against the previous run's, before the gate's tolerances.</p>
<p>Scenarios: $toc</p>
<details>
<summary>Runs, newest first</summary>
<table>
<thead><tr><th>date</th><th>commit</th><th>backend</th><th>mlx</th><th>mlx-lm</th>\
<th>variants completed</th></tr></thead>
<tbody>
$runs</tbody>
</table>
</details>
$sections</body>
</html>
""")


def page(record: Record) -> str:
    """The whole page for a record that holds at least one run."""
    runs = record.runs
    axis = TimeAxis(runs[0].date, runs[-1].date)
    names = sorted({name for run in runs for name in run.scenarios})
    latest = runs[-1]
    table = "".join(
        f"<tr><td>{run.date.strftime(MOMENT)}</td><td><code>{escape(run.commit)}</code></td>"
        f"<td>{escape(run.backend)}</td><td>{escape(run.mlx)}</td><td>{escape(run.mlx_lm)}</td>"
        f"<td>{sum(e.status == 'ok' for v in run.scenarios.values() for e in v.values())} of "
        f"{sum(len(v) for v in run.scenarios.values())}</td></tr>\n" for run in reversed(runs))
    return PAGE.substitute(
        count=len(runs), backend=escape(latest.backend), first=runs[0].date.strftime(MOMENT),
        last=latest.date.strftime(MOMENT), commit=escape(latest.commit), mlx=escape(latest.mlx),
        mlx_lm=escape(latest.mlx_lm), runs=table,
        toc=", ".join(f'<a href="#scenario-{i}">{escape(n)}</a>' for i, n in enumerate(names)),
        sections="".join(section(runs, name, i, axis) for i, name in enumerate(names)))


def write_site(record: Record, summaries: Sequence[Summary], out: Path) -> list[Path]:
    """`index.html`, `benchmark.json` (the night's `summaries`) and `history.json` in `out`,
    each written atomically; the record last, once the page it shows is written."""
    files = {"index.html": page(record), "benchmark.json": render_benchmark(summaries),
             "history.json": record.to_json()}
    for name, text in files.items():
        atomic_text(out / name, text)
    return [out / name for name in files]

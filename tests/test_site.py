"""`kvmem publish`: the history record kept across nights, and the static page drawn from it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from harness.cli import main
from harness.gate import site
from harness.gate.nightly import Record, parse_record
from tests.summaries import MiB, summary, write

ROOT = Path(__file__).resolve().parents[1]
SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def growth(tmp_path: Path) -> Path:
    """A real night: the committed qwen3_8b_growth baselines (kvcache and rotating), as a run at
    one commit records them (a re-recorded baseline carries its own revision)."""
    night = tmp_path / "growth"
    night.mkdir()
    for source in sorted((ROOT / "baselines" / "cpu" / "qwen3_8b_growth").glob("*.json")):
        data = json.loads(source.read_text())
        data["environment"]["git_revision"] = "317a29b"
        (night / source.name).write_text(json.dumps(data))
    return night


def publish(tmp_path: Path, *reports: str | Path, date: str, extra: tuple[str, ...] = ()) -> int:
    return main(["publish", *map(str, reports), "--site", str(tmp_path / "site"),
                 "--date", date, *extra])


def history(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "site" / "history.json").read_text())


def test_two_nights_make_a_record_of_two_runs_in_date_order(tmp_path, capsys, growth):
    assert publish(tmp_path, growth, date="2025-06-02T03:17:00Z") == 0
    out = capsys.readouterr().out
    assert f"no history at {tmp_path / 'site' / 'history.json'}: started a new one" in out
    assert "history: 1 runs, from 2025-06-02 to 2025-06-02; this one 2025-06-02 03:17 UTC, " \
           "commit 317a29b" in out
    night = tmp_path / "night"
    write(night, summary("qwen3_8b_growth", "kvcache", peak=700 * MiB,
                         environment={"mlx": "0.33.0", "git_revision": None}))
    # A later night, dated with an offset, read back in UTC; the commit given on the command line.
    assert publish(tmp_path, night, date="2025-06-03T05:17:00+02:00",
                   extra=("--commit", SHA)) == 0
    record = history(tmp_path)
    assert record["schema"] == 1
    assert record["units"] == {"peak": "bytes", "steady": "bytes", "final": "bytes",
                               "largest_spike": "bytes", "leak_rate": "bytes/req",
                               "retained": "bytes", "rss_peak": "bytes", "overhead_ratio": "ratio",
                               "buffers": "count", "host_rate": "bytes/req"}
    first, second = record["runs"]
    assert {k: v for k, v in first.items() if k != "scenarios"} == {
        "date": "2025-06-02T03:17:00Z", "commit": "317a29b", "backend": "cpu",
        "mlx": "0.32.4", "mlx_lm": "0.32.2"}
    recorded = json.loads((growth / "kvcache.json").read_text())["metrics"]
    assert first["scenarios"]["qwen3_8b_growth"]["kvcache"] == {"status": "ok", "metrics": {
        name: recorded[name] for name in record["units"] if name in recorded}}
    assert (recorded["steady"], recorded["overhead_ratio"]) == (528482304, 1.0205)
    assert sorted(first["scenarios"]["qwen3_8b_growth"]) == ["kvcache", "rotating"]
    assert second["date"] == "2025-06-03T03:17:00Z" and second["commit"] == SHA
    assert second["mlx"] == "0.33.0"
    assert second["scenarios"]["qwen3_8b_growth"]["kvcache"]["metrics"]["peak"] == 700 * MiB
    # A night older than the record's last goes in its place by date; --keep drops the oldest.
    older = tmp_path / "older"
    write(older, summary("qwen3_8b_growth", "kvcache"))
    assert publish(tmp_path, older, date="2025-06-01T03:17:00Z") == 0
    assert [r["date"][:10] for r in history(tmp_path)["runs"]] == [
        "2025-06-01", "2025-06-02", "2025-06-03"]
    assert publish(tmp_path, older, date="2025-06-04", extra=("--keep", "2")) == 0
    assert [(r["date"], r["commit"]) for r in history(tmp_path)["runs"]] == [
        ("2025-06-03T03:17:00Z", SHA), ("2025-06-04T00:00:00Z", "abc123")]


def test_the_site_holds_the_page_the_record_and_the_nights_benchmark_feed(tmp_path, capsys):
    night = tmp_path / "night"
    write(night, summary("trim", "after", peak=10 * MiB + 5))
    write(night, summary("trim", "before", status="failed"))
    assert publish(tmp_path, night, date="2025-06-01T03:17:00Z") == 0
    stdout, stderr = capsys.readouterr()
    assert sorted(p.name for p in (tmp_path / "site").iterdir()) == [
        "benchmark.json", "history.json", "index.html"]
    for name in ("index.html", "benchmark.json", "history.json"):
        assert f"wrote {tmp_path / 'site' / name}" in stdout
    assert "1 runs did not complete: recorded as such, left out of benchmark.json: trim/before" \
        in stderr
    assert main(["export", str(night)]) == 0
    assert (tmp_path / "site" / "benchmark.json").read_text() == capsys.readouterr().out
    entry = history(tmp_path)["runs"][0]["scenarios"]["trim"]["before"]
    assert entry == {"status": "failed", "error": "child died with signal 11", "metrics": {}}


def test_the_page_shows_dates_commits_units_and_escapes_names(tmp_path, growth):
    assert publish(tmp_path, growth, date="2025-06-02T03:17:00Z") == 0
    hostile = tmp_path / "hostile.json"
    hostile.write_text(json.dumps(summary("qwen3_8b_growth", "<script>alert(1)</script>",
                                          peak=3 * MiB)))
    assert publish(tmp_path, hostile, date="2025-06-03T03:17:00Z", extra=("--commit", SHA)) == 0
    html = (tmp_path / "site" / "index.html").read_text()
    assert "<script" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    # Dates on every x axis, the commits in the runs table and in the points' tooltips.
    start, end, y = site.LEFT + site.PAD, site.WIDTH - site.RIGHT - site.PAD, site.HEIGHT - 21
    assert html.count(f'<text x="{start}" y="{y}" text-anchor="start">2025-06-02</text>') == 24
    assert html.count(f'<text x="{end}" y="{y}" text-anchor="end">2025-06-03</text>') == 24
    assert "date (UTC)" in html
    assert f"<td><code>{SHA}</code></td>" in html and "<td><code>317a29b</code></td>" in html
    assert "<title>2025-06-02 03:17 UTC · commit 317a29b · 644 MiB</title>" in html
    assert "<title>2025-06-03 03:17 UTC · commit 0123456789ab · 3 MiB</title>" in html
    # Units on every axis: bytes in MiB, a rate per request, a ratio.
    assert '<text x="4" y="14" class="name">peak (MiB)</text>' in html
    assert 'class="tick">800 MiB</text>' in html
    assert '<text x="4" y="14" class="name">leak_rate (B/req)</text>' in html
    assert '<text x="4" y="14" class="name">overhead_ratio (×)</text>' in html
    # The summary table: latest value, change since the previous run, a sparkline.
    assert '<td rowspan="8">kvcache</td><td>peak</td><td>absent</td><td>—</td>' in html
    assert "<td>peak</td><td>3 MiB</td><td>new</td>" in html


def test_the_summary_table_gives_the_change_since_the_previous_run(tmp_path):
    for day, peak in (("2025-06-01", 600 * MiB), ("2025-06-02", 660 * MiB)):
        night = tmp_path / day
        write(night, summary("s", "v", peak=peak))
        assert publish(tmp_path, night, date=day) == 0
    html = (tmp_path / "site" / "index.html").read_text()
    assert "<td>peak</td><td>660 MiB</td><td>+60 MiB (+10.0%)</td>" in html
    assert "<td>steady</td><td>8 MiB</td><td>±0 B (+0.0%)</td>" in html


def published(tmp_path: Path) -> Record:
    """The record the site holds, as the next night reads it."""
    path = tmp_path / "site" / "history.json"
    return parse_record(path, path.read_bytes())


def svg(text: str) -> ET.Element:
    return ET.fromstring(text)


def test_charts_and_sparklines_start_from_zero(tmp_path):
    night = tmp_path / "n"
    write(night, summary("s", "v", peak=675328040, overhead_ratio=1.0205))
    write(night, summary("s", "w", steady=0))
    assert publish(tmp_path, night, date="2025-06-01") == 0
    record = published(tmp_path)
    scale = site.y_scale("peak", [675328040])
    assert (scale.ticks, scale.unit, scale.size) == ((0, 200, 400, 600, 800), "MiB", MiB)
    assert site.y_scale("overhead_ratio", [1.0205]).ticks == (0, 0.3, 0.6, 0.9, 1.2)
    assert site.y_scale("steady", [0.0]) == site.Scale((0, 1), "B", 1)
    assert site.y_scale("leak_rate", [1000]).ticks == (0, 250, 500, 750, 1000)
    axis = site.TimeAxis(record.runs[0].date, record.runs[-1].date)
    drawn = svg(site.chart(record.runs, "s", "v", "peak", axis))
    base = site.HEIGHT - site.BOTTOM
    ticks = {t.text: float(t.get("y")) - 3 for t in drawn.iter("text") if t.get("class") == "tick"}
    assert ticks == {"0 MiB": base, "200 MiB": 108, "400 MiB": 80, "600 MiB": 52, "800 MiB": 24}
    (point,) = drawn.iter("circle")
    assert float(point.get("cy")) == round(base - 675328040 / (800 * MiB) * (base - site.TOP), 1)
    assert float(point.get("cx")) == (site.LEFT + site.WIDTH - site.RIGHT) / 2  # one run: middle
    flat = svg(site.chart(record.runs, "s", "w", "steady", axis))
    assert [t.text for t in flat.iter("text") if t.get("class") == "tick"] == ["0 B", "1 B"]
    spark = svg(site.sparkline(record.runs, "s", "v", "peak", axis))
    assert spark.find("title").text == ("peak over 1 runs: 1 values, the highest 644 MiB; the "
                                        "axis starts at zero")
    low = site.SPARK_HEIGHT - 2
    assert spark.find("line").get("y1") == str(low)
    assert spark.find("circle").get("cy") == "2"  # the highest value, at the top
    zeros = svg(site.sparkline(record.runs, "s", "w", "steady", axis))
    assert zeros.find("circle").get("cy") == str(low)


def test_a_line_breaks_where_a_variant_is_absent_and_marks_a_failed_run(tmp_path):
    nights = [summary("s", "v", peak=10 * MiB), None, summary("s", "v", status="failed"),
              summary("s", "v", peak=12 * MiB)]
    for day, data in enumerate(nights, 1):
        night = tmp_path / f"n{day}"
        write(night, data or summary("s", "other"))
        assert publish(tmp_path, night, date=f"2025-06-0{day}") == 0
    record = published(tmp_path)
    axis = site.TimeAxis(record.runs[0].date, record.runs[-1].date)
    drawn = svg(site.chart(record.runs, "s", "v", "peak", axis))
    assert len(list(drawn.iter("polyline"))) == 2
    assert [c.find("title").text[:10] for c in drawn.iter("circle")] == ["2025-06-01",
                                                                         "2025-06-04"]
    (failed,) = drawn.iter("path")
    assert failed.find("title").text == ("2025-06-03 00:00 UTC · commit abc123 · failed: child "
                                         "died with signal 11")


def test_markers_mark_where_a_line_starts_moves_or_ends():
    xs = [float(x) for x in range(0, 40, 2)]
    values: list[float | None] = [1.0] * 5 + [2.0] * 5 + [None] + [3.0] * 9
    assert site._marks(xs, values) == [0, 5, 9, 11, 19]
    noisy = [float(i % 2) for i in range(20)]  # moves at every run, 2 px apart
    assert site._marks(xs, noisy) == [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 19]


MALFORMED = [
    ("not json", "corrupt JSON"),
    ("[]", "expected a JSON object"),
    ('{"schema": 2, "runs": []}', "unsupported history schema 2, expected 1"),
    ('{"schema": 1, "runs": {}}', "runs: Input should be a valid array"),
    ('{"schema": 1, "runs": [{"date": "yesterday"}]}', "runs.0.date: Input should be a valid"),
    ('{"schema": 1, "runs": [{"date": "2025-06-01T03:17:00"}]}',
     "runs.0.date: Input should have timezone info"),
    ('{"schema": 1, "runs": [RUN]}'.replace("RUN", json.dumps({
        "date": "2025-06-01T03:17:00Z", "commit": "abc123", "backend": "cpu", "mlx": "0.32.4",
        "mlx_lm": "0.32.2", "scenarios": {"s": {"v": {"status": "ok",
                                                       "metrics": {"peak": "10 MiB"}}}}})),
     "runs.0.scenarios.s.v.metrics.peak: Input should be a valid number"),
    ('{"schema": 1, "runs": [], "extra": 1}', "extra: unknown field"),
]


@pytest.mark.parametrize("text, message", MALFORMED)
def test_a_malformed_previous_history_is_bad_input_naming_the_field(tmp_path, capsys, text,
                                                                     message, growth):
    previous = tmp_path / "previous.json"
    previous.write_text(text)
    code = publish(tmp_path, growth, date="2025-06-01", extra=("--previous", str(previous)))
    err = capsys.readouterr().err
    assert code == 2
    assert f"error: {previous}: " in err and message in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "site").exists()


@pytest.mark.parametrize("setup, argv, message", [
    (lambda root: root.mkdir(), [], "no summaries found"),
    (lambda root: None, [], "no such file or folder"),
    (lambda root: (write(root, summary("s", "v")),
                   write(root, summary("s", "w", environment={"git_revision": "def456"}))),
     [], "the summaries do not share one git revision: pass --commit SHA"),
    (lambda root: (write(root / "a", summary("s", "v")),
                   write(root / "b", summary("s", "v", environment={"backend": "metal"}))),
     [], "summaries of several backends ('cpu', 'metal')"),
    (lambda root: write(root, summary("s", "v")), ["--commit", "HEAD"],
     "commit 'HEAD': expected a git commit SHA"),
])
def test_what_cannot_be_published_is_bad_input(tmp_path, capsys, setup, argv, message):
    setup(tmp_path / "night")
    assert publish(tmp_path, tmp_path / "night", date="2025-06-01", extra=tuple(argv)) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "site").exists()


def test_a_record_of_another_backend_is_bad_input(tmp_path, capsys):
    write(tmp_path / "cpu", summary("s", "v"))
    write(tmp_path / "metal", summary("s", "v", environment={"backend": "metal"}))
    assert publish(tmp_path, tmp_path / "cpu", date="2025-06-01") == 0
    before = (tmp_path / "site" / "history.json").read_bytes()
    assert publish(tmp_path, tmp_path / "metal", date="2025-06-02") == 2
    assert ("the history holds runs of backend 'cpu', these summaries are of 'metal'"
            in capsys.readouterr().err)
    assert (tmp_path / "site" / "history.json").read_bytes() == before


@pytest.mark.parametrize("argv, message", [
    (["--date", "yesterday"], "expected an ISO 8601 date and time"),
    (["--keep", "0"], "expected a whole number of runs from 1 to 100000"),
])
def test_publish_refuses_bad_flags(tmp_path, capsys, argv, message):
    write(tmp_path / "n", summary("s", "v"))
    with pytest.raises(SystemExit) as exit_info:
        main(["publish", str(tmp_path / "n"), "--site", str(tmp_path / "site"), *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_site_and_record_load_no_plotting_library():
    code = ("import sys, harness.gate.site, harness.gate.nightly; "
            "print(sorted(m for m in ('matplotlib', 'mlx', 'pandas') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, cwd=ROOT)
    assert result.stdout.strip() == "[]"


def test_every_chart_on_the_page_is_well_formed_svg(tmp_path, growth):
    assert publish(tmp_path, growth, date="2025-06-01") == 0
    html = (tmp_path / "site" / "index.html").read_text()
    drawings = re.findall(r"<svg .*?</svg>", html, re.S)
    assert len(drawings) == 2 * 16  # a chart and a sparkline per metric of each variant
    assert all(svg(d).tag == "svg" for d in drawings)

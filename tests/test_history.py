"""`kvmem export` (github-action-benchmark JSON) and `kvmem history` (a metric across runs)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from harness.cli import main
from harness.gate import history
from harness.store.summaries import summaries_under
from tests.summaries import MiB, summary, write

EXTRA = "cpu, mlx 0.32.4, mlx-lm 0.32.2"


def entries(scenario: str, variant: str, extra: str = EXTRA, **values) -> list[dict]:
    """The expected entries of one run, in METRICS order."""
    return [{"name": f"{scenario}/{variant} {metric}",
             "unit": "ratio" if metric == "overhead_ratio" else "bytes",
             "value": value, "extra": extra} for metric, value in values.items()]


def test_export_writes_each_gated_metric_of_each_completed_run(tmp_path, capsys):
    reports = tmp_path / "reports"
    write(reports, summary("trim", "after", peak=10 * MiB + 5, overhead_ratio=1.5))
    write(reports, summary("trim", "before", status="failed"))
    write(reports, summary("chat", "rolling", overhead_ratio=None, leak_rate=1234.5,
                           environment={"mlx": "0.33.0", "mlx_lm": "0.33.1"}))
    out = tmp_path / "feed" / "kvmem-benchmark.json"
    code = main(["export", str(reports), "--format", "github-action-benchmark", "--out", str(out)])
    stdout, stderr = capsys.readouterr()
    assert code == 0
    assert json.loads(out.read_text()) == [
        *entries("chat", "rolling", "cpu, mlx 0.33.0, mlx-lm 0.33.1", peak=10 * MiB,
                 steady=8 * MiB, final=MiB, largest_spike=MiB, leak_rate=1234.5, retained=0,
                 rss_peak=300 * MiB),
        *entries("trim", "after", peak=10 * MiB + 5, steady=8 * MiB, final=MiB,
                 largest_spike=MiB, leak_rate=0, retained=0, rss_peak=300 * MiB,
                 overhead_ratio=1.5),
    ]
    assert f"wrote {out}" in stdout
    assert "left out 1 runs that did not complete: trim/before" in stderr
    assert sorted(p.name for p in out.parent.iterdir()) == ["kvmem-benchmark.json"]
    # Without --out the same JSON goes to stdout.
    assert main(["export", str(reports)]) == 0
    assert capsys.readouterr().out == out.read_text()


def test_export_reads_several_folders_and_a_baselines_folder(tmp_path, capsys):
    write(tmp_path / "a", summary("s", "v1"))
    baselines = tmp_path / "baselines" / "cpu" / "s"
    baselines.mkdir(parents=True)
    (baselines / "v2.json").write_text(json.dumps(summary("s", "v2", peak=7)))
    assert main(["export", str(tmp_path / "a"), str(tmp_path / "baselines")]) == 0
    names = [e["name"] for e in json.loads(capsys.readouterr().out)]
    assert names[:2] == ["s/v1 peak", "s/v1 steady"] and "s/v2 peak" in names
    assert len(names) == 16


def test_export_refuses_two_summaries_of_one_variant(tmp_path, capsys):
    write(tmp_path / "cpu", summary("s", "v"))
    write(tmp_path / "metal", summary("s", "v", environment={"backend": "metal"}))
    assert main(["export", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "two summaries for s/v" in err and "one backend's summaries at a time" in err


@pytest.mark.parametrize("setup, message", [
    (lambda root: root.mkdir(), "no summaries found"),
    (lambda root: None, "no such file or folder"),
])
def test_export_without_summaries_is_bad_input(tmp_path, capsys, setup, message):
    setup(tmp_path / "empty")
    assert main(["export", str(tmp_path / "empty")]) == 2
    assert message in capsys.readouterr().err


def test_export_to_an_unwritable_path_is_bad_input(tmp_path, capsys):
    write(tmp_path / "r", summary("s", "v"))
    (tmp_path / "file").write_text("")
    assert main(["export", str(tmp_path / "r"), "--out", str(tmp_path / "file" / "x.json")]) == 2
    assert "cannot write" in capsys.readouterr().err


def three_runs(tmp_path):
    """Run 1 has everything; run 2 lacks trim/after; in run 3 trim/after failed."""
    one, two, three = (tmp_path / name for name in ("night1", "night2", "night3"))
    write(one, summary("trim", "after", peak=10 * MiB, environment={"git_revision": "aaa"}))
    write(one, summary("trim", "before", peak=20 * MiB, environment={"git_revision": "aaa"}))
    write(one, summary("chat", "rolling", peak=5 * MiB, environment={"git_revision": "aaa"}))
    write(two, summary("trim", "before", peak=22 * MiB, environment={"git_revision": "bbb"}))
    write(two, summary("chat", "rolling", peak=6 * MiB, environment={"git_revision": "bbb"}))
    write(three, summary("trim", "after", status="failed"))
    write(three, summary("trim", "before", peak=24 * MiB, steady=9 * MiB,
                         environment={"git_revision": "ccc"}))
    write(three, summary("chat", "rolling", peak=7 * MiB, environment={"git_revision": "ccc"}))
    return [str(p) for p in (one, two, three)]


def lines(fig) -> list[dict[str, list[float]]]:
    """Per axis: each line's label and its y values."""
    return [{line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
            for ax in fig.axes]


def same(actual: list[float], expected: list[float]) -> bool:
    return len(actual) == len(expected) and all(
        (math.isnan(a) and math.isnan(e)) or a == e for a, e in zip(actual, expected, strict=True))


def test_history_draws_one_line_per_variant_with_gaps_for_missing_runs(tmp_path):
    runs = history.points(three_runs(tmp_path))
    # Night 3's summaries do not share a revision (the failed run has the default): its name.
    assert [run.label for run in runs] == ["aaa", "bbb", "night3"]
    assert history.scenarios(runs) == ["chat", "trim"]
    fig = history.history_figure(runs, "trim", ["peak", "steady"])
    peak, steady = lines(fig)
    assert sorted(peak) == sorted(steady) == ["after", "before"]
    nan = math.nan
    assert same(peak["after"], [10, nan, nan])
    assert same(peak["before"], [20, 22, 24])
    assert same(steady["before"], [8, 8, 9])
    assert all(list(line.get_xdata()) == [0, 1, 2] for ax in fig.axes for line in ax.get_lines())
    assert [t.get_text() for t in fig.axes[-1].get_xticklabels()] == ["aaa", "bbb", "night3"]
    assert [ax.get_ylabel() for ax in fig.axes] == ["peak (MiB)", "steady (MiB)"]
    ratio = history.history_figure(runs, "chat", ["overhead_ratio"])
    assert lines(ratio) == [{"rolling": [1.25, 1.25, 1.25]}]
    assert ratio.axes[0].get_ylabel() == "overhead_ratio (ratio)"


def test_history_writes_one_png_per_scenario(tmp_path, capsys, monkeypatch):
    drawn = {}
    draw = history.history_figure

    def spy(runs, scenario, metrics):
        drawn[scenario] = fig = draw(runs, scenario, metrics)
        return fig

    monkeypatch.setattr(history, "history_figure", spy)
    out = tmp_path / "history"
    code = main(["history", *three_runs(tmp_path), "--out", str(out), "--metric", "peak"])
    assert code == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["chat.png", "trim.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") for p in out.iterdir())
    assert sorted(drawn) == ["chat", "trim"]
    assert [len(ax.get_lines()) for ax in drawn["trim"].axes] == [2]
    assert [len(ax.get_lines()) for ax in drawn["chat"].axes] == [1]
    assert same(lines(drawn["trim"])[0]["after"], [10, math.nan, math.nan])
    assert f"wrote {out / 'trim.png'}" in capsys.readouterr().out


def test_history_defaults_to_peak_and_steady(tmp_path, monkeypatch):
    seen = []
    draw = history.history_figure

    def spy(runs, scenario, metrics):
        seen.append(tuple(metrics))
        return draw(runs, scenario, metrics)

    monkeypatch.setattr(history, "history_figure", spy)
    assert main(["history", *three_runs(tmp_path), "--out", str(tmp_path / "h")]) == 0
    assert seen == [("peak", "steady")] * 2


def test_history_labels_runs_by_shared_revision_else_folder_and_keeps_labels_apart(tmp_path):
    a, b = tmp_path / "x" / "cpu", tmp_path / "y" / "cpu"
    write(a, summary("s", "v"))
    write(b, summary("s", "v"))
    runs = history.points([a, b])
    assert [run.label for run in runs] == ["abc123 (cpu)", "abc123 (cpu)"]
    write(b, summary("s", "w", environment={"git_revision": "def456"}))
    assert [run.label for run in history.points([a, b])] == ["abc123", "cpu"]


def test_history_lines_name_the_backend_when_runs_hold_several(tmp_path):
    write(tmp_path / "one", summary("s", "v"))
    write(tmp_path / "two", summary("s", "v", environment={"backend": "metal"}))
    runs = history.points([tmp_path / "one", tmp_path / "two"])
    assert lines(history.history_figure(runs, "s", ["peak"]))[0].keys() == {"v (cpu)", "v (metal)"}


@pytest.mark.parametrize("argv, message", [
    (["--metric", "nope"], "invalid choice: 'nope'"),
])
def test_history_refuses_an_unknown_metric(tmp_path, capsys, argv, message):
    write(tmp_path / "r", summary("s", "v"))
    with pytest.raises(SystemExit) as exit_info:
        main(["history", str(tmp_path / "r"), "--out", str(tmp_path / "h"), *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_history_refuses_what_it_cannot_plot(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["history", str(tmp_path / "empty"), "--out", str(tmp_path / "h")]) == 2
    assert "no summaries found" in capsys.readouterr().err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "summary.json").write_text(json.dumps(summary("..", "v")))
    assert main(["history", str(bad), "--out", str(tmp_path / "h")]) == 2
    assert "scenario '..' is a relative folder" in capsys.readouterr().err
    assert not (tmp_path / "h").exists()
    twice = tmp_path / "twice"
    write(twice / "a", summary("s", "v"))
    write(twice / "b", summary("s", "v"))
    assert main(["history", str(twice), "--out", str(tmp_path / "h")]) == 2
    assert "two summaries for s/v on backend cpu" in capsys.readouterr().err


def test_benchmark_entries_need_no_plotting_library():
    """The gate (compare, render, baselines, export) loads neither matplotlib nor MLX."""
    code = ("import sys, harness.gate, harness.gate.compare, harness.gate.render, "
            "harness.gate.baseline, harness.gate.history; "
            "print(sorted(m for m in ('matplotlib', 'mlx', 'pandas') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]"


def test_benchmark_entries_of_loaded_summaries(tmp_path):
    write(tmp_path, summary("s", "v", overhead_ratio=None))
    got = history.benchmark_entries(summaries_under(tmp_path))
    assert [e["name"] for e in got] == [f"s/v {m}" for m in (
        "peak", "steady", "final", "largest_spike", "leak_rate", "retained", "rss_peak")]
    assert {e["unit"] for e in got} == {"bytes"}

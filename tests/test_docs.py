"""Docs that cannot disagree with the code: the README's command table and guide list, the one
file map (CONTRIBUTING.md), and the README's figures, each held here to what it describes: the
parser, the docs folder, the harness's folders, and the committed baselines."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest

from harness.cli import parser
from harness.common.units import MiB

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _section(text: str, heading: str) -> str:
    """The text under a `## heading`, up to the next one."""
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_the_command_table_lists_every_command():
    (commands,) = [a for a in parser()._actions if a.dest == "command"]
    rows = [line for line in README.splitlines() if line.startswith("| `kvmem ")]
    listed = {row.split("`kvmem ", 1)[1].split()[0].split("\\")[0].rstrip("`") for row in rows}
    assert listed == set(commands.choices)


def test_the_documentation_list_links_every_guide():
    linked = set(re.findall(r"\]\(docs/([\w.]+\.md)\)", _section(README, "Documentation")))
    assert linked == {path.name for path in (ROOT / "docs").glob("*.md")}


FILE_MAP = _section((ROOT / "CONTRIBUTING.md").read_text(), "Where things live")


def _rows() -> dict[str, str]:
    """The file map's rows by folder (`harness/run/`), their text."""
    return {line.split("`")[1]: line for line in FILE_MAP.splitlines()
            if line.startswith("| `harness/")}


def test_the_file_map_names_every_folder_and_module_of_harness():
    rows = _rows()
    folders = {f"harness/{d.name}/" for d in (ROOT / "harness").iterdir()
               if (d / "__init__.py").is_file()}
    assert folders | {"harness/"} == set(rows)
    for folder, row in rows.items():
        modules = {p.name for p in (ROOT / folder).glob("*.py") if p.name != "__init__.py"}
        named = set(re.findall(r"`([\w]+\.py)`", row))
        assert named - {"__init__.py"} == modules, folder


def _baseline(scenario: str, variant: str) -> dict:
    return json.loads((ROOT / "baselines" / "cpu" / scenario / f"{variant}.json").read_text())


@cache
def _found(scenario: str, variant: str, kind: str) -> dict:
    return next(f for f in _baseline(scenario, variant)["findings"] if f["kind"] == kind)


def _metric(scenario: str, variant: str, name: str) -> float:
    return _baseline(scenario, variant)["metrics"][name]


def _mib(value: float, digits: int = 0) -> str:
    return f"{value / MiB:,.{digits}f}"


# Each row of the strategies table (by its scenario file) and the phrases it must hold, made
# from the committed baselines: a re-recorded baseline whose figure moved fails here until the
# README says so.
FIGURES: dict[str, Callable[[], list[str]]] = {
    "qwen3_8b_growth.yaml": lambda: [
        f"{_found('qwen3_8b_growth', 'kvcache', 'spike')['count']} spikes, peak "
        f"{_mib(_metric('qwen3_8b_growth', 'kvcache', 'peak'))} over a steady "
        f"{_mib(_metric('qwen3_8b_growth', 'kvcache', 'steady'))}"],
    "qwen3_8b_rotating.yaml": lambda: [
        f"holds {_mib(_metric('qwen3_8b_rotating', 'after', 'steady'))} from its first update",
        f"{_mib(_metric('qwen3_8b_rotating', 'after', 'peak'))} vs "
        f"{_mib(_metric('qwen3_8b_rotating', 'before', 'peak'))}"],
    "qwen3_8b_prefix_cache.yaml": lambda: [
        f"peak {_mib(_metric('qwen3_8b_prefix_cache', 'bug69', 'peak'))} vs "
        f"{_mib(_metric('qwen3_8b_prefix_cache', 'fix69', 'peak'))}"],
    "gemma26b_hot.yaml": lambda: [
        f"a {_mib(_found('gemma26b_hot', 'raw_bytes', 'host_memory')['bytes'])} MiB tier",
        f"one reported {_mib(_found('gemma26b_hot', 'snapshot_leak', 'unbounded')['bytes'])} "
        "MiB snapshot per block",
        f"keeps {_mib(_metric('gemma26b_hot', 'turboquant_dequantize', 'steady') - _metric('gemma26b_hot', 'turboquant_keep', 'steady'))} MiB of fp16"],  # noqa: E501
    "gemma_chat.yaml": lambda: [
        f"grows {_mib(_found('gemma_chat', 'rolling_off', 'unbounded')['bytes'])} MiB every turn",
        f"past a {_mib(_baseline('gemma_chat', 'rolling_off')['detect']['unbounded']['budget'])} "
        "MiB budget"],
    "import_path_leak.yaml": lambda: [
        f"exactly {_found('import_path_leak', 'leaky', 'unbounded')['bytes']:,} B per request"],
    "mlx_lm_server.yaml": lambda: [
        f"keep {_mib(_metric('mlx_lm_server', 'default', 'retained'), 1)} MiB beyond the "
        f"{_mib(_baseline('mlx_lm_server', 'default')['store_stats']['nbytes'], 1)} MiB the "
        "cache reports",
        f"{_mib(_metric('mlx_lm_server', 'concurrent', 'retained'))} MiB beyond "
        f"{_mib(_baseline('mlx_lm_server', 'concurrent')['store_stats']['nbytes'])} MiB",
        f"({_mib(_metric('mlx_lm_server', 'cache_bytes', 'steady'), 1)} MiB at rest)",
        f"({_mib(_baseline('mlx_lm_server', 'cache_bytes_kv8')['store_stats']['nbytes'])} MiB "
        f"reported, {_baseline('mlx_lm_server', 'cache_bytes_kv8')['store_stats']['entries']} "
        "entries)"],
    "vllm_mlx_server.yaml": lambda: [
        f"{_mib(_metric('vllm_mlx_server', 'batched', 'final'), 1)} MiB after 16",
        f"`gc_deferred` {_mib(_found('vllm_mlx_server', 'cache_memory', 'gc_deferred')['bytes'], 1)}",
        f"holds {_mib(_metric('vllm_mlx_server', 'kv_quantized', 'final'), 1)} MiB at rest",
        f"counts {_mib(_found('vllm_mlx_server', 'trie_stream', 'overclaimed')['bytes'], 1)} MiB"],
    "mlx_lm_versions.yaml": lambda: [
        f"{_mib(_metric('mlx_lm_versions', 'mlx_lm_0_31_3', 'steady'), 1)} MiB and "
        f"{_mib(_metric('mlx_lm_versions', 'mlx_lm_0_32_2', 'steady'), 1)} MiB, "
        f"{_mib(_metric('mlx_lm_versions', 'mlx_lm_0_32_2', 'retained'), 1)} MiB of it"],
    "mlx_lm_server_trace.yaml": lambda: [
        f"settles at {_mib(_metric('mlx_lm_server_trace', 'default', 'steady'), 1)} MiB"],
    "canaries.yaml": lambda: [
        f"`leak` {_mib(_found('canaries', 'broken_eviction', 'leak')['bytes'])} MiB per request",
        f"`unbounded` {_mib(_found('canaries', 'no_limit', 'unbounded')['bytes'])} MiB per request "
        f"past {_mib(_baseline('canaries', 'no_limit')['detect']['unbounded']['budget'])} MiB",
        f"`plateau` {_mib(_found('canaries', 'evicting', 'plateau')['bytes'])} MiB held",
        f"`retained` {_found('canaries', 'slice', 'retained')['bytes']:,} B",
        f"`gc_deferred` {_mib(_found('canaries', 'cyclic', 'gc_deferred')['bytes'])} MiB",
        f"`pooled` {_mib(_found('canaries', 'pooling', 'pooled')['bytes'])} MiB cached"],
}


@pytest.mark.parametrize("scenario", sorted(FIGURES))
def test_the_strategies_table_states_the_baselines(scenario):
    (row,) = [line for line in _section(README, "Strategies and scenarios").splitlines()
              if line.startswith(f"| `{scenario}` |")]
    for phrase in FIGURES[scenario]():
        assert phrase in row, phrase


def test_every_scenario_has_a_row_and_its_figures_are_checked():
    rows = re.findall(r"^\| `([\w]+\.yaml)` \|", _section(README, "Strategies and scenarios"),
                      re.MULTILINE)
    assert set(rows) == {path.name for path in (ROOT / "scenarios").glob("*.yaml")}
    assert set(FIGURES) <= set(rows)


def test_what_a_run_shows_states_the_growth_baseline():
    shown = _section(README, "What a run shows")
    growth = _found("qwen3_8b_growth", "kvcache", "growth")["bytes"]
    spike = _found("qwen3_8b_growth", "kvcache", "spike")["bytes"]
    steady = _metric("qwen3_8b_growth", "kvcache", "steady")
    for phrase in (f"256-slot steps of {_mib(growth)} MiB", f"rises\n{_mib(spike)} MiB above",
                   f"the settled {_mib(steady)} MiB", f"= {_mib(steady)} MiB"):
        assert phrase in shown, phrase

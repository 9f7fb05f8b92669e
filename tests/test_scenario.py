"""Scenario files: sizes, presets, variants, and clear errors (exit 2, field named) on bad input."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.cli import main
from harness.common.units import GiB, MiB, parse_size
from harness.scenario import ScenarioError
from harness.scenario import load_variants as load

VALID = """
model: qwen3-8b
workload: {requests: [{prompt: 10, decode: 2}]}
"""


def write(tmp_path, text: str, name: str = "s.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.parametrize("text, size", [
    (4096, 4096), ("512 MiB", 512 * MiB), ("2 GiB", 2 * GiB), ("1.5KiB", 1536), ("0", 0),
])
def test_sizes_accept_integers_and_binary_units(text, size):
    assert parse_size(text) == size


def test_name_defaults_to_the_file_stem_and_variants_merge_deeply(tmp_path):
    path = write(tmp_path, VALID + """
cache: {layer: {component: mlx_lm.RotatingKVCache, options: {max_size: 64}}}
variants:
  small: {}
  big: {cache: {layer: {options: {max_size: 128}}}, expect: {peak: 1 GiB}}
""", name="my_scenario.yaml")
    small, big = load(path)
    assert small.scenario == big.scenario == "my_scenario"
    assert (small.name, big.name) == ("small", "big")
    assert small.spec.cache.layer.options == {"max_size": 64}
    assert big.spec.cache.layer.component == "mlx_lm.RotatingKVCache"
    assert big.spec.cache.layer.options == {"max_size": 128}
    assert big.spec.expect.peak == GiB and small.spec.expect.peak is None
    assert [s.name for s in load(path, ["big"])] == ["big"]


def test_presets_can_be_cut_to_their_first_layers(tmp_path):
    path = write(tmp_path, """
model: {preset: gemma-4-26b-a4b, layers: 6, window: 128}
workload: {requests: [{prompt: 10}]}
""")
    geometry = load(path)[0].spec.geometry()
    assert [layer.kind for layer in geometry.layers] == ["sliding"] * 5 + ["full"]
    assert geometry.layers[0].window == 128 and geometry.vocab == 262144


BAD = {
    "unknown key": (VALID + "bogus: 1\n", "bogus: unknown field"),
    "wrong type": ("model: qwen3-8b\nworkload: {requests: [{prompt: ten}]}\n",
                   "workload.requests.0.prompt: Input should be a valid integer"),
    "negative size": (VALID + "expect: {peak: -5 MiB}\n",
                      "expect.peak: expected a size of zero or more bytes"),
    "negative count": ("model: qwen3-8b\nworkload: {prefill_chunk: -1, requests: [{prompt: 1}]}\n",
                       "workload.prefill_chunk: Input should be greater than or equal to 1"),
    "unknown component": (VALID + "cache: {layer: {component: mlx_lm.Nope}}\n",
                          "cache.layer.component: unknown component 'mlx_lm.Nope'"),
    "bad import path": (VALID + "cache: {store: {component: 'nosuch.module:make'}}\n",
                        "cache.store.component: cannot import module 'nosuch.module'"),
    "missing attribute": (VALID + "cache: {store: {component: 'tests.fixtures.components:Nope'}}\n",
                          "cache.store.component: 'tests.fixtures.components' has no callable"),
    "unknown option": (VALID + "cache: {layer: {component: mlx_lm.KVCache, options: {foo: 1}}}\n",
                       "cache.layer.options: got an unexpected keyword argument 'foo'"),
    "invalid yaml": ("model: qwen3-8b\nworkload: {requests: [{prompt: 10}\n",
                     "invalid YAML at line 3"),
    "not a mapping": ("- 1\n- 2\n", "(top level): expected a mapping"),
    "unknown preset": ("model: qwen9\nworkload: {requests: [{prompt: 1}]}\n",
                       "model.preset: unknown preset 'qwen9'"),
    "sliding without window": (
        "model: {layers: [{kind: sliding, kv_heads: 1, head_dim: 8}]}\n"
        "workload: {requests: [{prompt: 1}]}\n", "model.layers.0: a sliding layer needs a window"),
    "bad variant": (VALID + "variants: {after: {workload: {batch: 0}}}\n",
                    "variant 'after': workload.batch: Input should be greater than or equal to 1"),
    "bad expectation": (VALID + "expect: {leak: maybe}\n", "expect.leak: Input should be 'none'"),
    "prefix from the future": (
        "model: qwen3-8b\nworkload: {requests: [{prompt: 8, prefix: {request: 0, tokens: 4}}]}\n",
        "requests.0.prefix.request must name an earlier request"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_exits_2_naming_the_file_and_field(tmp_path, capsys, case):
    text, expected = BAD[case]
    path = write(tmp_path, text)
    assert main(["run", str(path), "--out", str(tmp_path / "out")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert str(path) in err.replace(" ", "") or str(path) in err
    assert expected in err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()  # nothing ran


def test_a_missing_file_and_an_unknown_variant_exit_2(tmp_path, capsys):
    assert main(["run", str(tmp_path / "absent.yaml")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    path = write(tmp_path, VALID)
    assert main(["run", str(path), "--variant", "nope"]) == 2
    assert "no variant nope" in capsys.readouterr().err


def test_the_module_entry_point_reports_without_a_traceback(tmp_path):
    path = write(tmp_path, VALID + "bogus: 1\n")
    done = subprocess.run([sys.executable, "-m", "harness", "run", str(path)],
                          capture_output=True, text=True)
    assert done.returncode == 2
    assert "bogus: unknown field" in done.stderr and "Traceback" not in done.stderr


FIELDS = ["name", "model", "cache", "workload", "requests", "prompt", "decode", "expect",
          "detect", "variants", "layers", "preset", "component", "options", "leak", "spike",
          "peak", "chat", "turns", "prefix", "repeat", "window", "kind", "count", "sampling"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                    st.sampled_from(["qwen3-8b", "512 MiB", "-1 GiB", "mlx_lm.KVCache", "detected",
                                     "x:y", "examples.leaky_store:LeakyStore", "full"]),
                    st.text(max_size=12))
documents = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6),
                                            inner, max_size=5)),
    max_leaves=25,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(document=documents)
def test_generated_structures_load_or_fail_with_a_scenario_error(tmp_path, document):
    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump(document))
    try:
        load(path)
    except ScenarioError as exc:
        assert str(path) in str(exc)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=200))
def test_arbitrary_text_loads_or_fails_with_a_scenario_error(tmp_path, text):
    path = tmp_path / "t.yaml"
    path.write_text(text)
    try:
        load(path)
    except ScenarioError as exc:
        assert str(path) in str(exc)


def test_the_console_script_finds_import_path_components_in_the_current_folder(tmp_path):
    """`kvmem` resolves `examples.leaky_store` from the current folder as `python -m` does."""
    script = Path(sys.executable).with_name("kvmem")
    if not script.exists():
        pytest.skip("the kvmem console script is not installed beside this interpreter")
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run([str(script), "run", "scenarios/import_path_leak.yaml", "--variant",
                           "clean", "--out", str(tmp_path / "out")],
                          cwd=repo, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "import_path_leak" / "clean" / "summary.json").exists()


def test_list_shows_the_real_model_presets_as_built(capsys, tmp_path):
    """Layers, KV per token and weights come from the built model (unevaluated), so a preset
    whose config drifts from its name shows it here."""
    assert main(["list", "--dir", str(tmp_path)]) == 0
    rows = {line.split("│")[1].strip(): [cell.strip() for cell in line.split("│")[2:-1]]
            for line in capsys.readouterr().out.splitlines() if line.count("│") >= 5}
    # Qwen3-0.6B: 28 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes = 112 KiB per token.
    assert rows["qwen3-0.6b"] == ["28 full", "112 KiB", "151,936", "1.11 GiB"]
    # The hybrid: every fourth layer is full attention, the others keep a recurrent state.
    assert rows["qwen3.5-0.8b"][0] == "6 full + 18 recurrent"
    assert rows["gemma-3-1b"][0] == "4 full + 22 sliding"

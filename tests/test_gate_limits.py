"""What the gate cannot promise, shown on the scratch repository of tests/test_gate_pr.py: code
written to behave differently under measurement passes it, and so does a leak that starts after
the scenario's last request. A soak (a longer workload; `kvmem run --duration` for a server) is
what finds the second. docs/gate.md's threat model cites these tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.test_gate_pr import FILE, branch, cli, commit, edit, gate, recorded  # noqa: F401

LIMITS = """\
import sys

from mlx_lm.models.cache import KVCache

KEPT = []  # what leaks: each cache's buffers, for the life of the process
MADE = []
# The scratch scenario makes 4 layer caches in a variant's process (2 layers, 2 of its 3
# requests; the prefix store gives the third its cache): a leak from the 5th on starts after
# its last request.
LATE = 4


class Evasive(KVCache):
    \"\"\"Keeps every key and value it is given, except where kvmem's probe is loaded.\"\"\"

    def __init__(self, spec):
        super().__init__()

    def update_and_fetch(self, keys, values):
        if "harness.run.probe" not in sys.modules:
            KEPT.append((keys, values))
        return super().update_and_fetch(keys, values)


class Late(KVCache):
    \"\"\"Clean for the first LATE caches a process makes; keeps every later one.\"\"\"

    def __init__(self, spec):
        super().__init__()
        MADE.append(None)
        if len(MADE) > LATE:
            KEPT.append(self)
"""
SOAK = """\
    - {prompt: 120, decode: 8}
    - {prompt: 160, decode: 8}
    - {prompt: 200, decode: 8}
    - {prompt: 240, decode: 8}
"""


def use(cache: str) -> None:
    """The branch's layer cache becomes `limits:<cache>`: a change the maintainers accept."""
    Path("limits.py").write_text(LIMITS)
    edit("layer: {component: mlx_lm.KVCache}", f'layer: {{component: "limits:{cache}"}}')
    commit(f"a layer cache of its own: {cache}")


def test_code_that_behaves_differently_under_measurement_passes(branch):  # noqa: F811
    use("Evasive")
    code, _, result = gate("--accept")
    assert (code, result["verdict"]) == (0, "no change")
    assert {c["what"] for c in result["changes"]} == {"scenario cache.layer.component"}
    # Outside kvmem's measurement, the same cache keeps what it is given.
    kept = subprocess.run(
        [sys.executable, "-c", "import limits, mlx.core as mx\n"
         "cache = limits.Evasive(None)\n"
         "for _ in range(3): cache.update_and_fetch(mx.zeros((1, 2, 4, 8)), mx.zeros((1, 2, 4, 8)))\n"
         "print(len(limits.KEPT))"],
        capture_output=True, text=True, check=True)
    assert kept.stdout == "3\n"


def test_a_leak_after_the_last_request_passes_and_a_soak_finds_it(branch):  # noqa: F811
    use("Late")
    code, _, result = gate("--accept")
    assert (code, result["verdict"]) == (0, "no change")
    # The same code under a longer workload: the caches made after the 4th stay alive.
    soak = Path("soak/gate_pr_soak.yaml")
    soak.parent.mkdir()
    soak.write_text(FILE.read_text().replace("name: gate_pr", "name: gate_pr_soak")
                    .replace("    - {prompt: 300, decode: 8}\n",
                             "    - {prompt: 300, decode: 8}\n" + SOAK))
    assert cli("run", str(soak), "--variant", "after", "--out", "reports-soak") == 1
    after = json.loads(Path("reports-soak/gate_pr_soak/after/summary.json").read_text())
    # Memory at rest grows request by request, and none of it is what the caches report.
    assert {"unbounded", "retained"} <= {f["kind"] for f in after["findings"]}

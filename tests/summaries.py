"""Summary dicts in the report schema (summary.json) and a small scenario, for the gate's tests."""

from __future__ import annotations

import json
from pathlib import Path

from harness.common.units import MiB

# A small prefix-store scenario for end-to-end runs (about 2 s each): `trim: slice` is its bug.
TRIM_SCENARIO = """\
name: gate_trim
description: A prefix store trims each finished request's cache before keeping it.
model: {dtype: float16, vocab: 1024, layers: [{count: 2, kind: full, kv_heads: 2, head_dim: 64}]}
cache:
  layer: {component: mlx_lm.KVCache}
  store: {component: reference.prefix_cache, options: {trim: copy}}
detect:
  retained: {min_bytes: 256 KiB}   # the default 1 MiB is more than this whole scenario holds
workload:
  prefill_chunk: 64
  requests:
    - {prompt: 100, decode: 8}
    - {prompt: 140, decode: 8, prefix: {request: 0, tokens: 100}}
    - {prompt: 300, decode: 8}
variants:
  after: {}
"""

ENVIRONMENT = {"backend": "cpu", "mlx": "0.32.4", "mlx_lm": "0.32.2", "python": "3.11.7",
               "machine": "x86_64", "platform": "Linux", "git_revision": "abc123"}


def summary(scenario: str, variant: str, status: str = "ok", environment: dict | None = None,
            compare: dict | None = None, **metrics) -> dict:
    """A schema-1 summary; active memory climbs linearly to `steady` over 64 samples."""
    values = {"peak": 10 * MiB, "steady": 8 * MiB, "final": 1 * MiB, "largest_spike": 1 * MiB,
              "leak_rate": 0, "retained": 0, "rss_peak": 300 * MiB, "overhead_ratio": 1.25,
              "minimum": 6 * MiB, "steps": 200, "wall_s": 0.5}
    values.update(metrics)
    return {
        "schema": 1, "scenario": scenario, "variant": variant,
        "scenario_file": f"scenarios/{scenario}.yaml", "status": status,
        "error": None if status == "ok" else "child died with signal 11",
        "exit_status": 0 if status == "ok" else -11, "last_step": 199,
        "metrics": values, "findings": [], "expectations": [], "passed": status == "ok",
        "compare": compare or {},
        "series": {"active": [values["steady"] * (i + 1) // 64 for i in range(64)]},
        "environment": {**ENVIRONMENT, **(environment or {})},
    }


def write(root: Path, data: dict) -> Path:
    """Write `data` in the report layout `<root>/<scenario>/<variant>/summary.json`."""
    path = root / data["scenario"] / data["variant"] / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path

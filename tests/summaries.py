"""Summary dicts in the report schema (summary.json), for the gate's tests."""

from __future__ import annotations

import json
from pathlib import Path

MiB = 1 << 20
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

"""Summaries on disk: the schema number, atomic writes, the environment, and reading them back.

A summary is the one file every later step reads (`show`, `compare`, `baseline`, `noise`), so
it is read in one place and checked as strictly as a scenario: a summary that cannot be
trusted is bad input naming its file and field, never a silent "no change".

Nothing here imports MLX, mlx-lm or matplotlib at import time: the gate reads summaries fast.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from .metrics import METRICS, NOISY
from .units import MAX_SIZE

SCHEMA = 1
UMASK = os.umask(0)
os.umask(UMASK)


class SummaryError(ValueError):
    """A summary that cannot be read or trusted; the message names the file. Exit status 2."""


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call `write` on a temporary file beside `path`, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o666 & ~UMASK)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_text(path: Path, text: str) -> None:
    def write(tmp: Path) -> None:
        tmp.write_text(text)

    atomic_write(path, write)


def backend() -> str:
    """Which MLX backend produces the figures: cpu, metal or cuda."""
    import mlx.core as mx  # here, not at the top: reading summaries must not load MLX

    if mx.default_device().type == mx.DeviceType.cpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    return "cuda"


def environment() -> dict:
    """What produced a run's figures; summaries from different backends are never compared."""
    import importlib.metadata as md

    try:
        revision = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
            check=False,
        ).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        revision = None
    return {
        "backend": backend(),
        "mlx": md.version("mlx"),
        "mlx_lm": md.version("mlx-lm"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "git_revision": revision,
    }


def finite(value: object) -> TypeGuard[float]:
    """A JSON number a metric can hold: not a bool, not NaN or infinite, and within the sizes
    that floats hold exactly (a 400-digit integer would overflow every rendering)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return abs(value) <= MAX_SIZE if isinstance(value, int) else math.isfinite(value)


@dataclass(frozen=True)
class Noise:
    """The run-to-run spread (max - min) of one metric over `runs` runs of a variant."""

    spread: float
    runs: int


@dataclass(frozen=True)
class Summary:
    """One variant's summary.json as loaded, with the file it came from."""

    path: Path
    data: dict

    @property
    def key(self) -> tuple[str, str]:
        return self.data["scenario"], self.data["variant"]

    @property
    def label(self) -> str:
        return "/".join(self.key)

    @property
    def backend(self) -> str:
        return self.environment.get("backend", "?")

    @property
    def environment(self) -> dict:
        return self.data.get("environment") or {}

    @property
    def ok(self) -> bool:
        return self.data.get("status") == "ok"

    def metric(self, name: str) -> float | None:
        value = (self.data.get("metrics") or {}).get(name)
        return value if finite(value) else None

    def noise(self, name: str) -> Noise | None:
        """The recorded run-to-run spread of a step-peak metric, from the `noise` block."""
        block = self.data.get("noise")
        if name not in NOISY or not isinstance(block, dict):
            return None
        if not isinstance(block.get(name), dict):
            return None
        return Noise(block[name]["spread"], block["runs"])


def read_summary(path: Path) -> Summary:
    """Load and check one summary, naming the file in every error."""
    try:
        data = json.loads(Path(path).read_bytes().decode("utf-8"))
    except OSError as exc:
        raise SummaryError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise SummaryError(f"{path}: not a valid summary (not UTF-8 text)") from None
    except RecursionError:
        raise SummaryError(f"{path}: not a valid summary (JSON nested too deeply)") from None
    except ValueError as exc:  # corrupt JSON, or an integer of more than 4,300 digits
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SummaryError(f"{path}: not a valid summary (corrupt JSON: {reason})") from None
    if not isinstance(data, dict):
        raise SummaryError(f"{path}: not a valid summary (expected a JSON object)")
    if data.get("schema") != SCHEMA:
        raise SummaryError(f"{path}: unsupported summary schema {_brief(data.get('schema'))}, "
                           f"expected {SCHEMA}")
    return checked(Summary(Path(path), data))


def checked(summary: Summary) -> Summary:
    """The summary, if it can be shown, compared and recorded; bad input naming its file."""
    problem = invalid(summary.data)
    if problem:
        raise SummaryError(f"{summary.path}: not a valid summary ({problem})")
    return summary


def invalid(data: dict) -> str | None:
    """Why a summary dict cannot be shown, compared or recorded, or None.

    A run that says ok must carry every compared metric as a finite number (overhead_ratio may
    be null: no analytic minimum): a child that stopped early once wrote `metrics: {}`, and
    comparing nothing with nothing read as "no change".
    """
    for name in ("scenario", "variant", "status"):
        if not isinstance(data.get(name), str):
            return f"missing or non-string '{name}'"
    environment = data.get("environment")
    if environment is not None and not isinstance(environment, dict):
        return "'environment' is not an object"
    if not isinstance((environment or {}).get("backend", "?"), str):
        return "'environment.backend' is not a string"
    if not isinstance(data.get("error"), (str, type(None))):
        return f"error: expected text, got {_brief(data.get('error'))}"
    if not isinstance(data.get("passed", False), bool):
        return f"passed: expected true or false, got {_brief(data.get('passed'))}"
    problem = _invalid_items(data, "findings", ("kind", "message"), str, "text") or \
        _invalid_items(data, "expectations", ("ok",), bool, "true or false")
    if problem:
        return problem
    metrics = data.get("metrics")
    if not isinstance(metrics, dict):
        return "no 'metrics' object"
    for name in METRICS:
        value = metrics.get(name)
        if not (value is None or finite(value)):
            return f"metrics.{name}: expected a finite number, got {_brief(value)}"
    if data["status"] != "ok":
        return None
    missing = [name for name in METRICS if name not in metrics]
    if missing:
        return f"status ok but metrics lack {', '.join(missing)}"
    nulls = [name for name in METRICS if metrics[name] is None and name != "overhead_ratio"]
    if nulls:
        return f"metrics.{nulls[0]}: expected a finite number, got null"
    return _invalid_noise(data.get("noise"))


def _invalid_items(data: dict, name: str, keys: tuple[str, ...], kind: type, what: str) -> str | None:
    """Why `data[name]`, a list of objects each holding `keys` of type `kind`, is not one."""
    items = data.get(name, [])
    if not isinstance(items, list):
        return f"{name}: expected a list, got {_brief(items)}"
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            return f"{name}.{i}: expected an object, got {_brief(item)}"
        for key in keys:
            if not isinstance(item.get(key), kind):
                return f"{name}.{i}.{key}: expected {what}, got {_brief(item.get(key))}"
    return None


def _brief(value: Any) -> str:
    """A JSON value as the file holds it, cut to fit an error line."""
    if isinstance(value, int) and abs(value) >= 10**40:
        return "a huge integer"  # json.dumps refuses more than 4,300 digits
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _invalid_noise(block: object) -> str | None:
    """Why a `noise` block (see harness.gate.noise) is malformed, or None when absent or sound."""
    if block is None:
        return None
    if not isinstance(block, dict):
        return "'noise' is not an object"
    runs = block.get("runs")
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        return f"noise.runs: expected a count of runs, got {_brief(runs)}"
    for name in NOISY:
        entry = block.get(name)
        if entry is None:
            continue
        spread = entry.get("spread") if isinstance(entry, dict) else None
        if not finite(spread) or spread < 0:
            return f"noise.{name}.spread: expected a size of zero or more bytes"
    return None


def load_summaries(path: str | Path) -> list[Summary]:
    """Summaries under `path`: a summary file, a report folder, or a baselines folder.

    Folders are walked for `summary.json` files (report layout); a folder holding none is read
    as a baselines folder, where every `*.json` is a summary.
    """
    path = Path(path)
    if path.is_file():
        return [read_summary(path)]
    if not path.is_dir():
        raise SummaryError(f"{path}: no such file or folder")
    try:
        files = _visible(path, "summary.json") or _visible(path, "*.json")
    except OSError as exc:
        raise SummaryError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return [read_summary(f) for f in files]


def _visible(root: Path, pattern: str) -> list[Path]:
    """Files under `root` matching `pattern`, leaving out hidden names at any depth.

    Atomic writes leave `.summary.json.<random>.json` files, and report folders are staged as
    `.<variant>.new.<random>/`, when interrupted: half-written data, never a summary.
    """
    return sorted(f for f in root.rglob(pattern)
                  if not any(part.startswith(".") for part in f.relative_to(root).parts))

"""A server's model: its folder, geometry and weight bytes, made by the Python that serves it.

A server in an environment of its own (`server.requires`) has the mlx-lm it will load the model
with, and kvmem may have none (kvmem installs without mlx-lm beside servers that pin another).
So the folder is written, and the model described, by the server's interpreter: it runs this
module's `main` with only kvmem's `harness` package on its path (a folder holding a link to it),
which needs MLX, mlx-lm, numpy and tokenizers, all of which an MLX server has. Without an
environment of its own, kvmem's process does the same work itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..common.lifeline import die_with_parent
from . import geometry as geo
from .loading import ModelChoice, ModelError

HARNESS = Path(__file__).resolve().parent.parent
TIMEOUT = 600.0  # seconds: building a folder trains a tokenizer and writes the weights


PACKAGES = ("mlx", "mlx-lm")  # what a server's own environment is always asked the versions of


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """The folder, geometry and weight bytes; `packages`, from a server's own interpreter, the
    versions there of MLX, mlx-lm and the packages asked about."""

    folder: Path
    geometry: geo.Geometry
    weights: int
    packages: dict[str, str] | None = None


def _to_json(geometry: geo.Geometry) -> dict[str, Any]:
    layers = [{**dataclasses.asdict(layer), "dtype": geo.dtype_name(layer.dtype)}
              for layer in geometry.layers]
    return {"name": geometry.name, "vocab": geometry.vocab, "layers": layers}


def _from_json(data: dict[str, Any]) -> geo.Geometry:
    layers = tuple(geo.LayerSpec(**{**layer, "dtype": geo.mlx_dtype(layer["dtype"])})
                   for layer in data["layers"])
    return geo.Geometry(name=data["name"], layers=layers, vocab=data["vocab"])


def main() -> None:
    """In the server's interpreter: `{"choice": ModelChoice's fields, "packages": names}` as
    JSON on stdin; the folder, the geometry, the weight bytes and the installed versions of
    those packages as JSON on stdout, or `{"error": ...}`."""
    import importlib.metadata as md

    from .folder import folder
    from .loading import describe

    asked = json.load(sys.stdin)
    choice = ModelChoice(**asked["choice"])
    versions = {}
    for name in asked["packages"]:
        with contextlib.suppress(md.PackageNotFoundError):
            versions[name] = md.version(name)
    try:
        geometry, weights = describe(choice)
        answer: dict[str, Any] = {"folder": str(folder(choice)), "geometry": _to_json(geometry),
                                  "weights": weights, "packages": versions}
    except ModelError as exc:
        answer = {"error": str(exc)}
    json.dump(answer, sys.stdout)


@functools.lru_cache(maxsize=8)
def prepare(choice: ModelChoice, python: str | None = None,
            packages: tuple[str, ...] = ()) -> ServedModel:
    """The model folder a server loads and its facts: made here, or by `python` (the server's
    own interpreter) where given, which also says its versions of MLX, mlx-lm and `packages`.
    Raises ModelError with the reason."""
    if python is None:
        from .folder import folder
        from .loading import describe

        geometry, weights = describe(choice)
        return ServedModel(folder(choice), geometry, weights)
    from .folder import cache_root

    with tempfile.TemporaryDirectory(prefix="kvmem-path-") as path:
        os.symlink(HARNESS, Path(path) / "harness")  # kvmem's harness alone, nothing else
        # Run from that folder, with the cache's path made absolute: `-c` puts the working
        # directory first on sys.path, and a repository's own `harness/` there would replace
        # kvmem's (Python before 3.11 ignores PYTHONSAFEPATH).
        env = {**os.environ, "PYTHONPATH": path, "PYTHONSAFEPATH": "1",
               "KVMEM_CACHE": str(cache_root().resolve())}
        try:
            done = subprocess.run(
                [python, "-c", "from harness.models.serving import main; main()"],
                input=json.dumps({"choice": dataclasses.asdict(choice),
                                  "packages": [*PACKAGES, *packages]}),
                capture_output=True, text=True,
                env=env, cwd=path, timeout=TIMEOUT,
                preexec_fn=functools.partial(die_with_parent, os.getpid()))
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ModelError(f"cannot build the model with {python}: {exc}") from None
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise ModelError(f"the server's Python could not build the model ({python}):\n{tail}")
    answer = json.loads(done.stdout)
    if "error" in answer:
        raise ModelError(answer["error"])
    return ServedModel(Path(answer["folder"]), _from_json(answer["geometry"]), answer["weights"],
                       answer["packages"])

"""What a variant was measured with beside its scenario, as its summary's environment records
it: the class of machine (`runner`), the code that ran before kvmem bound MLX's counters
(`preloaded`) and the model folder the scenario points at (`model_folder`). The gate counts
each in the yardstick (harness.gate.yardstick); summaries written before they were recorded
lack them, and nothing is compared there."""

from __future__ import annotations

from pydantic import BaseModel, StrictInt, StrictStr

from ..common.strict import Strict


class _Fact(Strict):
    """One fact of the environment, as recorded."""


class Runner(_Fact):
    """The class of machine that measured (harness.run.environment.runner): the gate lists a
    head measured on another class than its baseline as a change to the yardstick."""

    backend: StrictStr
    machine: StrictStr
    cpus: StrictInt  # those the process may run on
    memory_gib: StrictInt  # total memory, rounded to GiB
    os: StrictStr

    def __str__(self) -> str:
        return (f"{self.backend}, {self.machine}, {self.cpus} CPUs, {self.memory_gib} GiB, "
                f"{self.os}")


class Preloaded(_Fact):
    """Code that runs before kvmem binds MLX's counters (harness.run.preloaded): `kind` is
    sitecustomize, usercustomize, pth or shadow (a package of the repository named as mlx,
    mlx_lm or harness); `path` is relative to the repository or to site-packages."""

    kind: StrictStr
    path: StrictStr
    sha256: StrictStr


class FolderDigest(_Fact):
    """The model folder a variant loads by path, as the scenario names it, with the digest of
    its files (harness.common.digest)."""

    path: StrictStr
    sha256: StrictStr
    files: StrictInt
    bytes: StrictInt


class Provenance(BaseModel):
    """The summary environment's fields of this module (harness.judge.summary.Environment
    derives from it); None where a summary does not record them. Fields alone, no settings of
    its own: Environment takes those of the summary's records."""

    runner: Runner | None = None
    preloaded: list[Preloaded] | None = None
    model_folder: FolderDigest | None = None

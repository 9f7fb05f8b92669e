"""Code that runs before kvmem binds MLX's counters, listed so that a change to it is a change
to the yardstick: the `sitecustomize` and `usercustomize` modules Python imports at start-up,
the `.pth` files of site-packages that execute code (lines starting with `import`), and
top-level packages or modules of the repository under test named as `mlx`, `mlx_lm` or
`harness`, which every measuring child imports in place of the real ones.

The measuring child is a fresh interpreter of the same executable, started in the same folder
with the same `sys.path` (harness.common.child), so it finds the same files; they are listed
from kvmem's own process. Each is named relative to the repository or to its site-packages
folder, never by an absolute path, and the list is sorted, so unchanged code lists the same on
every run and machine. kvmem's own agent `sitecustomize` (injected into servers) and the `.pth`
file of kvmem's own installation (an editable one's, whose name carries the version) are not
foreign and are left out.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata as md
import site
import sys
from pathlib import Path

from ..common.digest import file_sha256, tree_digest

SHADOWED = ("mlx", "mlx_lm", "harness")  # what a repository's own top-level names must not be
AGENT = Path(__file__).resolve().parent.parent / "agent" / "sitecustomize.py"
KVMEM = Path(__file__).resolve().parent.parent  # kvmem's own `harness` package


def _site_folders() -> list[Path]:
    """The site-packages folders Python reads `.pth` files from, each once."""
    folders = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    if site.ENABLE_USER_SITE:
        folders.append(site.getusersitepackages())
    seen: dict[Path, None] = {}
    for folder in folders:
        if Path(folder).is_dir():
            seen.setdefault(Path(folder).resolve(), None)
    return list(seen)


def _named(path: Path, top: Path) -> str:
    """`path` relative to the site-packages folder holding it (`site-packages/x.pth`: a
    virtual environment inside the repository too), else to the repository (`./x.py`), else
    to Python's prefix (`prefix/lib/...`), else as it is."""
    resolved = path.resolve()
    roots = [*((folder, "site-packages") for folder in _site_folders()), (top.resolve(), "."),
             (Path(sys.prefix).resolve(), "prefix"), (Path(sys.base_prefix).resolve(), "prefix")]
    for root, name in roots:
        if root in resolved.parents:
            return f"{name}/{resolved.relative_to(root).as_posix()}"
    return resolved.as_posix()


def _pth_files() -> list[tuple[Path, list[str]]]:
    """Each `.pth` file of site-packages with its lines (one unreadable is left out: Python
    skips it too)."""
    found = []
    for folder in _site_folders():
        for path in sorted(folder.glob("*.pth")):
            try:
                found.append((path, path.read_text(encoding="utf-8",
                                                   errors="replace").splitlines()))
            except OSError:
                continue
    return found


def _executes(line: str) -> bool:
    return line.startswith(("import ", "import\t"))  # what `site` executes


def _pth_folders() -> list[str]:
    """The folders `.pth` files add to the path (a start-up module may have taken its own out
    of `sys.path`)."""
    return [str(path.parent / line.strip()) for path, lines in _pth_files() for line in lines
            if line.strip() and not line.startswith("#") and not _executes(line)]


def _customizers() -> list[tuple[str, Path]]:
    """Each start-up module Python imported (or would find, where the module took itself out
    of `sys.modules` or its folder out of `sys.path`), by the file it came from."""
    found = []
    for name in ("sitecustomize", "usercustomize"):
        module = sys.modules.get(name)
        file = getattr(module, "__file__", None) if module is not None else None
        if file is None:
            spec = importlib.machinery.PathFinder.find_spec(name, sys.path[1:] + _pth_folders())
            file = spec.origin if spec is not None and spec.has_location else None
        if file is not None and Path(file).is_file() and Path(file).resolve() != AGENT:
            found.append((name, Path(file)))
    return found


def _own_files() -> set[Path]:
    """The `.pth` files kvmem's own installation put in site-packages (an editable install's):
    the measuring tool, which the summary records by its version, not code under test."""
    found = md.distributions(name="kvmem", path=[str(f) for f in _site_folders()])
    return {Path(str(installed.locate_file(f))).resolve() for installed in found
            for f in installed.files or [] if f.name.endswith(".pth")}


def _executing_pth() -> list[Path]:
    """The `.pth` files of site-packages with a line Python executes (one starting with
    `import`, followed by a space or a tab), kvmem's own left out."""
    own = _own_files()
    return [path for path, lines in _pth_files()
            if any(_executes(line) for line in lines) and path.resolve() not in own]


def _shadows(top: Path) -> list[Path]:
    """Top-level packages or modules of the repository named as what kvmem measures with;
    kvmem's own `harness`, in kvmem's repository, is itself."""
    found = []
    for name in SHADOWED:
        for path in (top / name, top / f"{name}.py"):
            if path.exists() and path.resolve() != KVMEM:
                found.append(path)
    return found


def _entry(kind: str, path: Path, top: Path) -> dict[str, str]:
    try:
        digest = tree_digest(path).sha256 if path.is_dir() else file_sha256(path)
    except OSError as exc:
        digest = f"unreadable: {exc.strerror or exc}"
    return {"kind": kind, "path": _named(path, top), "sha256": digest}


def preloaded(top: Path) -> list[dict[str, str]]:
    """Everything of the module docstring, as the summary's `environment.preloaded` records
    it: kind, path, sha256 (of a folder's files for a package), sorted by kind and path."""
    entries = [_entry(kind, path, top) for kind, path in _customizers()]
    entries += [_entry("pth", path, top) for path in _executing_pth()]
    entries += [_entry("shadow", path, top) for path in _shadows(top)]
    return sorted(entries, key=lambda e: (e["kind"], e["path"]))

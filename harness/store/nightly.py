"""The nightly record's file, as the last published site holds it (`history.json`): its bytes
for `harness.gate.nightly` to parse, or None where no record is there yet."""

from __future__ import annotations

from pathlib import Path

from . import StoreError


def read_nightly(path: Path) -> bytes | None:
    """The record's bytes at `path`; None when no file is there (a new history starts), bad
    input naming the file when the system refuses it."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StoreError(f"{path}: cannot read: {exc.strerror or exc}") from None

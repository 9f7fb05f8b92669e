"""The results store: the one reader of what runs and the gate left behind.

Summaries, report folders' rows, committed baselines, the folders `kvmem history` plots and
the nightly record are opened here alone, from the working tree (`summaries`, `rows`,
`nightly`) or from git at a revision (`git`). Each format is parsed where its model is (a
summary by `harness.judge.summary`, the nightly record by `harness.gate.nightly`): the store
finds the files, reads them and hands over bytes, rows or models, so a reader's errors (a
file that cannot be read, a revision git does not know) are worded once.

Its layer lies below `run/` (merge reads shards through it; gate and the command line sit
higher still) and above `report/`, whose file names it reads back, and `judge/`, whose
`Summary` it hands over.
"""

from __future__ import annotations

from ..common.errors import BadInput


class StoreError(BadInput):
    """Stored results that cannot be read: git at a revision, a missing baselines folder, a
    file the system refuses. Exit status 2."""

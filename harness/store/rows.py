"""A report folder's rows read back: samples.csv and holders.csv as the run judged them (for
the gate's recomputation), and the samples an overlay plot draws (for `kvmem merge`).

pandas is imported when rows are read, so the gate's other readers start without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..common.echo import clip
from ..judge.summary import SummaryError
from ..report.writing import HOLDERS, SAMPLES, ReportError

if TYPE_CHECKING:
    import pandas as pd

# holders.csv's columns of text: read as written, an empty path or a holder named `NA` too.
_TEXT = ("holder", "path", "root")
PLOTTED = ("step", "active", "peak")  # the columns an overlay draws


def judged_rows(folder: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A variant's samples and holders as its run judged them, read back from samples.csv and
    holders.csv (empty where the run walked none): phases as the probe's categories, `time`
    in the float32 the probe kept (samples.csv holds each value's shortest decimal, which
    reads back to the same float32). Missing or unreadable rows are bad input naming the
    file."""
    import pandas as pd

    from ..agent.kvmem_sample import PHASES

    samples = _csv(folder / SAMPLES, required=True)
    if not samples.empty:
        unknown = sorted(set(samples["phase"].astype(str)) - set(PHASES)) \
            if "phase" in samples else ["(none)"]
        others = [c for c in samples.columns if c != "phase"
                  and not pd.api.types.is_numeric_dtype(samples[c])]
        if unknown or others:
            what = f"phase {unknown[0]!r}" if unknown else f"column {others[0]!r} is not numeric"
            raise ReportError(f"{folder / SAMPLES}: unreadable rows ({what})")
        samples["phase"] = pd.Categorical(samples["phase"], categories=PHASES)
        if "time" in samples:
            samples["time"] = samples["time"].astype("float32")
    return samples, _csv(folder / HOLDERS, required=False)


def _csv(path: Path, required: bool) -> pd.DataFrame:
    """One CSV of a report folder; where it is missing, bad input if `required` else empty."""
    import pandas as pd

    try:
        return pd.read_csv(path, dtype={name: str for name in _TEXT}, keep_default_na=False)
    except FileNotFoundError:
        if required:
            raise ReportError(f"{path}: missing: the report has no rows to judge") from None
        return pd.DataFrame()
    except (OSError, ValueError) as exc:  # pandas' parser and empty-file errors among them
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ReportError(f"{path}: unreadable rows ({reason})") from None


def plotted_samples(folder: Path) -> pd.DataFrame:
    """A variant folder's samples, checked before anything is written: UTF-8 CSV whose plotted
    columns hold numbers; empty where the run left none (a refused or failed variant)."""
    import pandas as pd

    path = folder / SAMPLES
    try:
        frame = pd.read_csv(path, encoding="utf-8")
    except (FileNotFoundError, pd.errors.EmptyDataError):
        return pd.DataFrame()
    except UnicodeDecodeError:
        raise SummaryError(f"{path}: not valid samples (not UTF-8 text)") from None
    except (OSError, ValueError) as exc:  # pandas' ParserError is a ValueError
        reason = clip(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        raise SummaryError(f"{path}: not valid samples ({reason})") from None
    if frame.empty:
        return frame
    missing = [name for name in PLOTTED if name not in frame.columns]
    if missing:
        raise SummaryError(f"{path}: not valid samples (lacks {', '.join(missing)}; expected "
                           f"the columns {', '.join(PLOTTED)})")
    for name in PLOTTED:
        if not pd.api.types.is_numeric_dtype(frame[name]):
            raise SummaryError(f"{path}: not valid samples ({name}: expected numbers)")
    return frame

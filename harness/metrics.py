"""The metrics a summary reports and `kvmem compare` gates on, all lower-is-better.

One place that the scenario schema (`expect.compare` keys), the summaries and the comparison
import, kept apart from each so that none imports another.
"""

METRICS = (
    "peak", "steady", "final", "largest_spike", "leak_rate", "retained", "rss_peak",
    "overhead_ratio",
)
# Step-peak metrics move run to run on CPU, so their spread is measured; active-byte metrics are
# exact and must be identical run to run.
NOISY = ("peak", "largest_spike")
EXACT = ("steady", "final", "retained", "leak_rate")

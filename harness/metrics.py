"""The metrics a summary reports and `kvmem compare` gates on, all lower-is-better.

One tuple that both the scenario schema (`expect.compare` keys) and the comparison import,
kept apart from both so that neither imports the other.
"""

METRICS = (
    "peak", "steady", "final", "largest_spike", "leak_rate", "retained", "rss_peak",
    "overhead_ratio",
)

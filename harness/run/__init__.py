"""Running a scenario: the engine loop, its K/V source, the probe, one process per variant."""

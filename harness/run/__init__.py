"""Running a scenario: engines behind one protocol, the probe, one process per variant,
scheduling, the suite end to end, repeated runs and merged shards."""

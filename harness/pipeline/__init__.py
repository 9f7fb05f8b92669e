"""The one orchestrator: the variants a command measures, one process per variant, scheduling
and shards, the suite end to end, a run's samples judged into its summary, repeated runs and
merged shards. It builds on `harness.run`, which measures one variant in one process."""

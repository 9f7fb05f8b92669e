"""From samples to a verdict: metrics, detectors, expectations and the typed summary. Imports
no MLX: the gate reads summaries through it."""

"""The regression gate: summaries compared and rendered, kept as baselines and history, and the
pull-request check.

Nothing here imports MLX, mlx-lm or matplotlib: comparing two folders of summaries takes the
time of reading them.
"""

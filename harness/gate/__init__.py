"""The regression gate: compare summaries, render the comparison, keep baselines, measure noise.

Nothing here imports MLX, mlx-lm or matplotlib: comparing two folders of summaries takes the
time of reading them.
"""

"""What every layer uses: byte units, echoed values, path-safe names, atomic writes, the one
error type of bad input, the strict schema base, child processes that cannot outlive kvmem, and
mlx-lm's caches without its package start-up."""

"""Small pieces every layer uses: byte units, echoed values, path-safe names, atomic writes,
child processes that cannot outlive kvmem."""

"""kvmem: memory profiling and regression gate for KV-cache strategies on MLX."""

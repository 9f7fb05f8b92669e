"""Reference implementations of KV-cache strategies, with their known bugs switchable."""

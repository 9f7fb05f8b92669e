"""Cache components: the protocols they implement, the registry that names them, the adapters
that drive mlx-lm's own classes, and the version bounds their packages declare."""

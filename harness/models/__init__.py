"""Models: cache geometries, the presets in one table, real mlx-lm models and the local model
folders a server loads."""

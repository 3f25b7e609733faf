"""The scheduling core: pure, synchronous policy (no Trio, no MLX)."""

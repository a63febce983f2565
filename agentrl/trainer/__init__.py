"""Training: the PPO loop, backends, checkpoints and metrics."""

"""The training loop and what it needs: optimizer, schedule, checkpoints, metrics, loggers."""

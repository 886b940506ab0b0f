"""state transfer to joining peers, checkpoints."""

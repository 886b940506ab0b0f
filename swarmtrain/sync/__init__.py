"""State transfer to joining peers, checkpoints.

checkpoint.py: crash-safe save/resume of a peer's whole state (safetensors + self-checked manifest).
"""

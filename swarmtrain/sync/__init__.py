"""State transfer to joining peers, checkpoints.

checkpoint.py: crash-safe save/resume of a peer's whole state (safetensors + self-checked manifest).
transfer.py: StateServer / fetch_state, the streamed, sha256-checked download of the newest committed state.
export.py: a checkpoint (or a model) as a Hugging Face directory, and a model back from a checkpoint.
votes.py: where a voter keeps its votes, one crash-safe file per averaging scope.
"""

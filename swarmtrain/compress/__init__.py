"""tensors <-> bytes, no networking. codec.py: the Codec protocol."""

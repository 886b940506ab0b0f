"""fused CPU and CUDA kernels for the codecs (built at run time)."""

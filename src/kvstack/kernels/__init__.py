"""Compute kernels chosen per shape: C kernels for decode-sized products, PyTorch otherwise."""

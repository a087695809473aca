"""Decode kernels (CuTe DSL on GPU) with PyTorch references and shape dispatch."""

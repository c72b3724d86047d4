"""Fused Triton kernels with autograd wrappers and plain-torch references, behind a registry."""

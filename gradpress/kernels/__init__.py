"""The numba/SIMD layer, the randomized Hadamard transform and bit packing: compiled kernels with
a public interface each that the compressors import.
"""

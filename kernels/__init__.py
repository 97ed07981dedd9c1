"""Kernels for the small hot ops of a speculative round: a torch reference twin for each (`kernels.reference`), a
Triton kernel for each (`kernels.triton_ops`), and one dispatch point (`kernels.ops`) that speclab calls."""

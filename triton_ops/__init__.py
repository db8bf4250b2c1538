"""Triton kernels of kvkernels, one op per file, each with one launcher (``*_triton``).

Import this package only after deciding on ``TRITON_INTERPRET`` (the CPU interpreter is chosen
when the kernels are decorated). :func:`kvkernels.backends.triton_available` does it lazily.
"""

from .gather import gather_triton
from .scatter import scatter_triton

__all__ = ["gather_triton", "scatter_triton"]

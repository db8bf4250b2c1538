"""CUDA C++ sources of kvkernels (shipped as package data so the backend can be built just in
time). Nothing to import here: the compiled library is loaded by ``kvkernels._cuda``."""

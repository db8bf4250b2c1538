"""Benchmarks (installed as ``kvkernels.bench`` so ``kvkernels bench NAME`` works anywhere).

One script per measured thing, each with ``main(argv)``, runnable at tiny sizes in the tests.
"""

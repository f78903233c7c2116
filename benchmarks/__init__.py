"""Benchmarks (run as modules: python -m benchmarks.<name>).

They measure the server as it runs: OpenMP's spin count gets the server's default before any
benchmark imports torch (`scheduler.omp_spin`), for our side and the transformers baseline alike.
"""

from scheduler.omp_spin import apply_default_spin

apply_default_spin()

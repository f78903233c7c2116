"""Benchmarks (run as modules: python -m benchmarks.<name>).

They measure the server as it runs: OpenMP's spin count and torch's huge-page allocation get the
server's defaults before any benchmark imports torch (`scheduler.cpu_env`), for our side and the
transformers baseline alike.
"""

from hybrid_serve.scheduler.cpu_env import apply_cpu_defaults

apply_cpu_defaults()

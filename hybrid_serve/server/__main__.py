"""`python -m hybrid_serve.server` is the `hybrid-serve` command."""

from hybrid_serve.server.cli import main

main()

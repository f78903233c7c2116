"""`python -m server` is the `hybrid-serve` command."""

from server.cli import main

main()

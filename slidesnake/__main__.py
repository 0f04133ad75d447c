"""`python -m slidesnake`: the `slidesnake` command."""

from slidesnake.cli import main

main()

"""`python -m cli`: the `peagle` command, whether or not the console script is on PATH."""

from cli import main

main()

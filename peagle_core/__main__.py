"""`python -m peagle_core`: the library CLI alone."""

from peagle_core.cli import main

main()

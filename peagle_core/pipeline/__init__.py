"""The one pipeline of a job, for `peagle train` and the worker alike: regenerate, prepare,
hidden states, train, export, over a small store protocol; the typed result.

Kept empty: importing the package loads none of its modules (or torch).
"""

"""The drafter: configuration, decoder layers and parallel-depth attention, COD sampling, the
training objective and its loss, and the speculators checkpoint format it is saved in.

Kept empty: importing the package loads none of its modules (or torch).
"""

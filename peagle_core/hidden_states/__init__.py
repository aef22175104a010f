"""The verifier's hidden states: running the verifier, the sharded on-disk cache (storage codec,
build and verify), and the sources and batch loader training reads them through.

Kept empty: importing the package loads none of its modules (or torch).
"""

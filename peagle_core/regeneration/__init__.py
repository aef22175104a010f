"""Regeneration: the verifier rewrites every assistant turn of a chat dataset (transformers or vLLM
generators), resumable and keyed by what it read.

Kept empty: importing the package loads none of its modules (or torch).
"""

"""Acceptance length measured by us: greedy speculative decoding with drafter and verifier
(batched, KV-cached), per position.

Kept empty: importing the package loads none of its modules (or torch).
"""

"""What vLLM serves: export and validation of a checkpoint, the publish gate and vLLM as a judge (per prompt category too), and the `vllm serve` command.

Kept empty: importing the package loads none of its modules (or torch).
"""

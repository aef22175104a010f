"""Training a drafter: the parts built from a spec (and `model.init_from`), the loop, resume state, the learning-rate
schedule, torch.distributed plumbing, and job planning.

Kept empty: importing the package loads none of its modules (or torch).
"""

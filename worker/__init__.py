"""Runs training jobs: the RQ worker pool, the job runner driving peagle_core, progress, cancel, reconciler.

Writes rows only through `service.crud`; imports the control plane, never the other way round.
"""

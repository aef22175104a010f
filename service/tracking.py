"""Where the API and the worker agree to find a job's tracker output (`tracking.report_to`)."""

from __future__ import annotations


def tensorboard_key(job_id: str) -> str:
    """The artifact-store folder of a job's TensorBoard event files (one file per attempt)."""
    return f"jobs/{job_id}/tensorboard"

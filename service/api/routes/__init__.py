"""REST routes under /v1 plus health and metrics."""

"""The HTTP layer: dependencies, error envelope, schemas and routes (FastAPI)."""

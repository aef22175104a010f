"""Web control plane: FastAPI routes, DB models and queries, settings. No torch at import time."""

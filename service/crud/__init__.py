"""Database queries, one module per resource; every read is scoped to a project."""

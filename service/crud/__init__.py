"""The only code that writes rows (API, worker and CLI alike), plus the queries; one module per resource.

Reads the API serves are scoped to a project; the worker's and the reconciler's reads are not.
"""

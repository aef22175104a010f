"""The control plane: settings, database (models, sessions, crud), artifact store, queue, HTTP API, metrics.

Never imports worker, client or cli; no torch at import time (the API starts fast).
"""

"""The Python SDK over the peagle HTTP API: `PeagleClient(url, key)`, errors raised as `ClientError`.

Imports nothing from the server side (service, worker), so it works on any machine that reaches the API.
"""

from client.sdk import TERMINAL_STATUSES, ChecksumMismatch, ClientError, PeagleClient

__all__ = ["TERMINAL_STATUSES", "ChecksumMismatch", "ClientError", "PeagleClient"]

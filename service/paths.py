"""Which server-side paths a job spec may name: only those under operator-allowed roots.

verifier.name_or_path (or a hub id when PEAGLE_ALLOW_HUB is on) and model.init_from must be directories under
PEAGLE_ALLOWED_MODEL_ROOTS; dataset.path and hidden_states.cache_uri must lie under PEAGLE_ALLOWED_DATA_ROOTS.
Symlinks and `..` are resolved before the check, so neither can escape a root.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from peagle_core.spec import JobSpec, SpecError
from service.settings import Settings

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def under_roots(path: str | os.PathLike[str], roots: Sequence[str | os.PathLike[str]]) -> Path | None:
    """The fully resolved `path` if it lies inside one of `roots` (also resolved), else None."""
    resolved = Path(path).expanduser().resolve()
    for root in roots:
        if resolved.is_relative_to(Path(root).expanduser().resolve()):
            return resolved
    return None


def _local(value: str) -> str | None:
    # A plain path or file:// URI is local; any other scheme (s3://, hf://) is not a server path.
    if value.startswith("file://"):
        return value.removeprefix("file://")
    return None if "://" in value else value


def _check_path(value: str, roots: Sequence[Path], param: str, what: str, *, must_be: str | None) -> None:
    local = _local(value)
    if local is None:
        raise SpecError([(param, f"{value!r} is not a local path; only server paths under an allowed root")])
    if not os.path.isabs(os.path.expanduser(local)):
        raise SpecError([(param, f"{what} must be an absolute path under an allowed root")])
    if not roots:
        raise SpecError(
            [(param, f"server {what}s are disabled on this service (no allowed roots configured)")]
        )
    resolved = under_roots(local, roots)
    if resolved is None:
        raise SpecError([(param, f"{value!r} is outside the allowed roots for {what}s")])
    if must_be == "dir" and not resolved.is_dir():
        raise SpecError([(param, f"{value!r} is not an existing directory")])
    if must_be == "file" and not resolved.is_file():
        raise SpecError([(param, f"{value!r} is not an existing file")])


def check_spec_paths(spec: JobSpec, settings: Settings, *, prefix: str = "spec.") -> None:
    """Raise SpecError (param = the dotted field) for any path or option the operator has not allowed."""
    verifier = spec.verifier.name_or_path
    param = f"{prefix}verifier.name_or_path"
    looks_like_path = os.path.isabs(os.path.expanduser(verifier)) or verifier.startswith((".", "file://"))
    if not looks_like_path and _HUB_ID.match(verifier) and not os.path.exists(verifier):
        if not settings.allow_hub:
            raise SpecError([(param, f"hub model ids ({verifier!r}) are disabled on this service")])
    else:
        _check_path(verifier, settings.allowed_model_roots, param, "model path", must_be="dir")
    if spec.verifier.trust_remote_code and not settings.allow_trust_remote_code:
        raise SpecError(
            [(f"{prefix}verifier.trust_remote_code", "trust_remote_code is disabled on this service")]
        )
    if spec.model.init_from is not None:
        init = f"{prefix}model.init_from"
        _check_path(spec.model.init_from, settings.allowed_model_roots, init, "model path", must_be="dir")
    if spec.dataset.path is not None:
        _check_path(
            spec.dataset.path,
            settings.allowed_data_roots,
            f"{prefix}dataset.path",
            "data path",
            must_be="file",
        )
    if spec.hidden_states.cache_uri is not None:
        _check_path(
            spec.hidden_states.cache_uri,
            settings.allowed_data_roots,
            f"{prefix}hidden_states.cache_uri",
            "cache path",
            must_be=None,
        )

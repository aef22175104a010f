"""Which server-side paths a job spec may name: only those under operator-allowed roots.

verifier.name_or_path (or a hub id when PEAGLE_ALLOW_HUB is on) and model.init_from must be directories under
PEAGLE_ALLOWED_MODEL_ROOTS; dataset.path must lie under PEAGLE_ALLOWED_DATA_ROOTS, or under
`PEAGLE_PROJECT_FILES_ROOT/<project id>/` for the owning project only. `file://` URIs are normalised to plain
paths, `~` is refused (it would name the server's home), and symlinks and `..` are resolved before the check,
so none of them can escape a root. The service's own state (data dir, local artifact store) is never
reachable, except a project's own files area. hidden_states.cache_uri is written to, so it must lie inside
the project's own files area (shared data roots are read by other projects), never be the area itself, and
never be inside a model root or a directory holding a model (one project's shards in a model others load).
The API checks at create time and stores the normalised paths; the worker checks again against its
current settings before it uses them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import unquote, urlsplit

from peagle_core.spec import JobSpec, SpecError
from service.settings import Settings

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def under_roots(path: str | os.PathLike[str], roots: Sequence[str | os.PathLike[str]]) -> Path | None:
    """The fully resolved `path` if it lies inside one of `roots` (also resolved), else None."""
    resolved = Path(path).resolve()
    for root in roots:
        if resolved.is_relative_to(Path(root).expanduser().resolve()):
            return resolved
    return None


def _local(value: str, param: str) -> str | None:
    """A plain path for a local value (`file:///x` -> `/x`); None for another scheme (s3://, hf://)."""
    if value.startswith("~"):
        raise SpecError([(param, f"{value!r}: '~' is not expanded on the server; give an absolute path")])
    if value.startswith("file:"):
        parts = urlsplit(value)
        if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
            raise SpecError([(param, f"{value!r}: only file:///absolute/path URIs name a server path")])
        return unquote(parts.path)
    return None if "://" in value else value


def _service_state(settings: Settings) -> list[Path]:
    """Directories holding the service's own state: the database, keys, every project's artifacts."""
    state = [Path(settings.data_dir).resolve()]
    if "://" not in settings.artifact_root or settings.artifact_root.startswith("file://"):
        state.append(Path(settings.artifact_root.removeprefix("file://")).resolve())
    return state


def _project_area(settings: Settings, project_id: str | None) -> Path | None:
    if settings.project_files_root is None or project_id is None:
        return None
    return (Path(settings.project_files_root).resolve() / project_id).resolve()


def _check_path(
    value: str,
    roots: Sequence[Path],
    param: str,
    what: str,
    *,
    must_be: str | None,
    settings: Settings | None = None,
    project_id: str | None = None,
) -> Path:
    local = _local(value, param)
    if local is None:
        raise SpecError([(param, f"{value!r} is not a local path; only server paths under an allowed root")])
    if not os.path.isabs(local):
        raise SpecError([(param, f"{what} must be an absolute path under an allowed root")])
    own = _project_area(settings, project_id) if settings is not None else None
    if not roots and own is None:
        raise SpecError(
            [(param, f"server {what}s are disabled on this service (no allowed roots configured)")]
        )
    resolved = under_roots(local, [*roots, *([own] if own else [])])
    if resolved is None:
        raise SpecError([(param, f"{value!r} is outside the allowed roots for {what}s")])
    if settings is not None and not (own is not None and resolved.is_relative_to(own)):
        files_root = settings.project_files_root
        if files_root is not None and resolved.is_relative_to(Path(files_root).resolve()):
            raise SpecError(
                [(param, f"{value!r} is in the per-project files area, outside this project's own directory")]
            )
        granted = [r for r in (Path(r).expanduser().resolve() for r in roots) if resolved.is_relative_to(r)]
        for state in _service_state(settings):
            # Inside the service's state only through a root the operator opened strictly inside it
            # (`peagle up`'s <data_dir>/models); a wider root, or one equal to it, does not reach in.
            opened = any(r != state and r.is_relative_to(state) for r in granted)
            if (resolved.is_relative_to(state) and not opened) or state.is_relative_to(resolved):
                raise SpecError(
                    [(param, f"{value!r} overlaps the service's own data (database, keys, artifacts)")]
                )
    if must_be == "dir" and not resolved.is_dir():
        raise SpecError([(param, f"{value!r} is not an existing directory")])
    if must_be == "file" and not resolved.is_file():
        raise SpecError([(param, f"{value!r} is not an existing file")])
    return resolved


# What makes a directory a model (a verifier, a drafter checkpoint, a tokenizer): Hugging Face's config and
# tokenizer files and safetensors weights. A hidden-state cache holds `manifest.json` and
# `shard-NNNNN.safetensors` (peagle_core.hidden_states.cache), so its own shards do not count.
_MODEL_FILES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.model",
        "special_tokens_map.json",
        "vocab.json",
        "merges.txt",
    }
)
_CACHE_SHARD = re.compile(r"^shard-\d+\.safetensors$")
# Listing a huge directory to find out is not worth it: a directory this big is no model's.
_MAX_SCAN_ENTRIES = 10_000


def holds_model(directory: Path) -> bool:
    """Whether `directory` holds model files (config/tokenizer files or safetensors weights)."""
    try:
        with os.scandir(directory) as entries:
            for n, entry in enumerate(entries):
                if n >= _MAX_SCAN_ENTRIES:
                    return False
                name = entry.name
                if name in _MODEL_FILES or (name.endswith(".safetensors") and not _CACHE_SHARD.match(name)):
                    return True
    except OSError:  # missing or unreadable: nothing a model could be loaded from
        return False
    return False


def model_home(path: Path) -> Path | None:
    """The nearest of `path` and its ancestors that holds a model, if any."""
    for candidate in (path, *path.parents):
        if holds_model(candidate):
            return candidate
    return None


def _check_cache_dir(resolved: Path, settings: Settings, project_id: str | None, param: str) -> None:
    # A cache directory is written to (and may be cleaned): only the project's own area, where no other
    # project reads, and never anything a model is loaded from.
    own = _project_area(settings, project_id)
    if own is None or not resolved.is_relative_to(own):
        raise SpecError(
            [
                (
                    param,
                    "a cache directory must be inside this project's files area (PEAGLE_PROJECT_FILES_ROOT/"
                    "<project>/), where no other project reads; omit it to use the service's cache store",
                )
            ]
        )
    if resolved == own:
        raise SpecError(
            [(param, "the cache must be a sub-directory of your files area, not the area itself")]
        )
    for root in (Path(r).expanduser().resolve() for r in settings.allowed_model_roots):
        if resolved.is_relative_to(root) or root.is_relative_to(resolved):
            raise SpecError(
                [(param, "the cache directory overlaps an allowed model root: models are read from there")]
            )
    if model_home(resolved) is not None:
        raise SpecError([(param, "the cache directory is inside a directory holding a model")])


def check_spec_paths(
    spec: JobSpec, settings: Settings, *, prefix: str = "spec.", project_id: str | None = None
) -> JobSpec:
    """Raise SpecError (param = the dotted field) for any path or option the operator has not allowed;
    return the spec with its server paths normalised (absolute, `file://` stripped, symlinks resolved)."""
    updates: dict[str, dict[str, str]] = {}
    verifier = _check_verifier(spec, settings, prefix)
    if verifier is not None:
        updates["verifier"] = {"name_or_path": str(verifier)}
    # (section, field, roots, what, must be, the project whose own files area counts as a root too)
    server_paths = (
        ("model", "init_from", settings.allowed_model_roots, "model path", "dir", None),
        ("dataset", "path", settings.allowed_data_roots, "data path", "file", project_id),
        ("hidden_states", "cache_uri", settings.allowed_data_roots, "cache path", None, project_id),
    )
    for section, field, roots, what, must_be, owner in server_paths:
        value = getattr(getattr(spec, section), field)
        if value is None:
            continue
        param = f"{prefix}{section}.{field}"
        resolved = _check_path(
            value, roots, param, what, must_be=must_be, settings=settings, project_id=owner
        )
        if section == "hidden_states":
            _check_cache_dir(resolved, settings, project_id, param)
        updates[section] = {field: str(resolved)}
    if not updates:
        return spec
    data = spec.model_dump(mode="json", exclude_unset=True)
    for section, values in updates.items():
        data.setdefault(section, {}).update(values)
    return JobSpec.model_validate(data)


def _check_verifier(spec: JobSpec, settings: Settings, prefix: str) -> Path | None:
    """The verifier's resolved directory, or None for a hub id (allowed only with `allow_hub`); refuses
    `trust_remote_code` unless the operator allows it."""
    verifier = spec.verifier.name_or_path
    param = f"{prefix}verifier.name_or_path"
    resolved = None
    looks_like_path = os.path.isabs(verifier) or verifier.startswith((".", "file:", "~"))
    if not looks_like_path and _HUB_ID.match(verifier) and not os.path.exists(verifier):
        if not settings.allow_hub:
            raise SpecError([(param, f"hub model ids ({verifier!r}) are disabled on this service")])
    else:
        resolved = _check_path(
            verifier, settings.allowed_model_roots, param, "model path", must_be="dir", settings=settings
        )
    if spec.verifier.trust_remote_code and not settings.allow_trust_remote_code:
        raise SpecError(
            [(f"{prefix}verifier.trust_remote_code", "trust_remote_code is disabled on this service")]
        )
    return resolved

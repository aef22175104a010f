"""The job's regeneration stage: reuse, resume or run the verifier's rewrite of the data, keyed by fingerprint.

Results live under `regenerated/<key>/` in the artifact store, shared by the project's jobs with the same
verifier files, source bytes and parameters, like prepared data and hidden-state caches.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from peagle_core.io import sha256_file
from peagle_core.regenerate import (
    RegenReport,
    params_for_spec,
    provenance_path,
    read_provenance,
    regen_fingerprint,
    regenerate,
    verifier_fingerprint,
    work_log_path,
)
from peagle_core.spec import JobSpec
from service.artifacts import ArtifactStore

log = logging.getLogger(__name__)

DATA = "data.jsonl"
Event = Callable[[str, str, dict[str, Any] | None], None]


def regenerated_source(
    store: ArtifactStore,
    scratch_root: Path,
    spec: JobSpec,
    data_path: Path,
    source_sha: str,
    project_id: str,
    *,
    enter_stage: Callable[[str, dict[str, Any]], None],
    event: Event,
    on_progress: Callable[[dict[str, Any]], None],
    should_stop: Callable[[], bool],
    on_stored: Callable[[str, Path], None] | None = None,
) -> tuple[Path, str] | None:
    """`(path, sha256)` of the regenerated JSONL for this job, or None when `should_stop` stopped it.

    The stage is entered (`enter_stage`) only when there is generating to do; a reused result is a log event.
    `on_stored(key, local_dir)` is told where the result lives once it is reused or published.
    """
    params = params_for_spec(spec)
    verifier_fp = verifier_fingerprint(spec.verifier.name_or_path, spec.verifier.revision)
    fp = regen_fingerprint(verifier_fp, source_sha, params)
    # Per project, like prepared data: a project never learns (from a reuse, or its speed) that another
    # one regenerated the same data.
    key = "regenerated/" + hashlib.sha256(json.dumps([project_id, fp]).encode()).hexdigest()[:32]
    local = store.local_path(key)
    work_dir = local if local is not None else scratch_root / key
    out = work_dir / DATA
    if (
        local is None
        and store.exists(f"{key}/{provenance_path(Path(DATA)).name}")
        and read_provenance(out) is None
    ):
        store.fetch_dir(key, work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    # Two jobs asking for the same rewrite on one machine: the second waits, then finds it finished.
    with open(work_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        prov = read_provenance(out)
        if prov is not None and prov.get("fingerprint") == fp:
            event(
                "log",
                f"reusing regenerated data {fp[:12]} ({prov['counts']['written']} conversations)",
                {"kind": "regenerate", "reused": True, "fingerprint": fp, "counts": prov["counts"]},
            )
            if on_stored is not None:
                on_stored(key, work_dir)
            return out, sha256_file(out)
        resumed = _work_log_rows(work_log_path(out))
        enter_stage(
            "regenerate",
            {"engine": params.engine, "max_new_tokens": params.max_new_tokens, "fingerprint": fp,
             "resume_from": resumed},
        )  # fmt: skip
        if resumed:
            event("log", f"resuming regeneration after {resumed} conversations", {"kind": "regenerate",
                  "resume_from": resumed})  # fmt: skip

        def progress(r: RegenReport) -> None:
            left = r.total - r.conversations
            rate = (r.conversations - r.resumed_from) / r.seconds if r.seconds > 0 else 0.0
            on_progress({"done": r.conversations, "total": r.total, "tokens_per_s": round(r.tokens_per_s, 1),
                         "eta_s": round(left / rate, 1) if rate > 0 else None})  # fmt: skip

        report = regenerate(
            spec.verifier.name_or_path,
            data_path,
            out,
            params,
            revision=spec.verifier.revision,
            trust_remote_code=spec.verifier.trust_remote_code,
            on_progress=progress,
            should_stop=should_stop,
            verifier_fp=verifier_fp,
        )
        if report.status == "stopped":
            event("log", f"regeneration stopped after {report.conversations} of {report.total} conversations",
                  {"kind": "regenerate", **report.to_dict()})  # fmt: skip
            return None
    counts = report.to_dict()
    event(
        "log",
        f"regenerated {report.written} conversations ({report.turns} turns; {report.skipped_prompt_too_long} "
        f"prompts too long, {report.dropped_empty} empty answers dropped, {report.hit_max_new_tokens} hit "
        f"max_new_tokens) at {report.tokens_per_s:.0f} tokens/s",
        {"kind": "regenerate", "reused": False, **counts},
    )
    if local is None:
        store.publish_dir(work_dir, key)
    if on_stored is not None:
        on_stored(key, work_dir)
    return out, sha256_file(out)


def _work_log_rows(path: Path) -> int:
    """Conversations an interrupted run already appended (the header line excluded)."""
    if not path.is_file():
        return 0
    return max(0, path.read_bytes().count(b"\n") - 1)

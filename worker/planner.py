"""The plan task's body: plan a spec on this worker's device, reusing the rates stored for the same setup.

Rates live in the artifact store under `plans/rates/<key>.json` (`peagle_core.training.plan.rates_key`: device,
verifier, drafter shape, lengths, regeneration), written after each calibration.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from peagle_core.errors import PeagleError
from peagle_core.spec import JobSpec
from peagle_core.training.plan import Rates, device_name, plan_job, rates_key
from service.artifacts import ArtifactStore
from service.settings import Settings

RATES_PREFIX = "plans/rates"


def plan_for_api(settings: Settings, spec_dict: dict[str, Any], data: dict[str, Any], *,
                 recalibrate: bool = False) -> dict[str, Any]:  # fmt: skip
    """The plan, or `{"error": {code, message, param}}` for a spec the data or verifier refuses.

    `data` is `{"path": ...}` (a server path) or `{"uri": ..., "sha256": ...}` (an uploaded dataset).
    """
    spec = JobSpec.model_validate(spec_dict)
    store = ArtifactStore(settings.artifact_root)
    scratch = Path(settings.data_dir) / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch, prefix="plan-") as tmp:
        try:
            data_path = _data_path(store, data, Path(tmp))
            key = f"{RATES_PREFIX}/{rates_key(spec, device_name())}.json"
            rates = None
            if not recalibrate and store.exists(key):
                with store.open_read(key) as f:
                    rates = Rates.from_json(json.loads(f.read()))
            local_root = store.local_path(RATES_PREFIX)
            disk = local_root.parent.parent if local_root is not None else scratch
            plan, used = plan_job(
                spec, data_path, Path(tmp), rates=rates, free_bytes=shutil.disk_usage(disk).free
            )
        except PeagleError as exc:
            return {"error": exc.to_dict()}
    if rates is None:
        store.write_bytes(key, json.dumps(asdict(used), sort_keys=True).encode())
    return plan


def _data_path(store: ArtifactStore, data: dict[str, Any], tmp: Path) -> Path:
    if data.get("path"):
        return Path(data["path"])
    local = store.local_path(data["uri"])
    return local if local is not None else store.fetch_file(data["uri"], tmp / "data.jsonl")

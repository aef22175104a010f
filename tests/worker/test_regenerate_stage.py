"""The regeneration stage in real workers: it runs before data preparation, a second job reuses its result,
and a cancel during it stops cleanly while a later job with the same spec resumes where it stopped."""

from __future__ import annotations

import json
from pathlib import Path

from peagle_core.toy import write_toy_dataset
from tests.worker.conftest import Stack, toy_spec

REGEN = {"max_new_tokens": 8}


def _regen_dir(stack: Stack) -> Path:
    # The project's own stage outputs (worker.runner): projects/<id>/regenerated/<stage key>/.
    root = Path(stack.settings.artifact_root) / "projects" / stack.project_id / "regenerated"
    (out,) = [d for d in root.iterdir() if d.is_dir()]
    return out


def test_regeneration_runs_before_prepare_and_a_second_job_reuses_it(
    stack: Stack, toy_verifier_dir: Path, toy_dataset_path: Path
) -> None:
    spec = toy_spec(
        toy_verifier_dir,
        toy_dataset_path,
        dataset={"regenerate": REGEN, "max_samples": 32},
        training={"max_steps": 2},
    )
    first, second = stack.submit(spec), stack.submit(spec)
    stack.run_burst()
    for job_id in (first, second):
        job = stack.job(job_id)
        assert job.status == "succeeded", (job.error, [e.message for e in stack.events(job_id)])

    events = stack.events(first)
    stages = [e.data["stage"] for e in events if e.type == "stage"]
    assert stages.index("regenerate") < stages.index("prepare") < stages.index("train")
    (done,) = [e for e in events if e.data and e.data.get("kind") == "regenerate"]
    assert done.data["reused"] is False and done.data["written"] == done.data["total"] == 32
    for key in ("skipped_prompt_too_long", "dropped_empty", "hit_max_new_tokens", "tokens_per_s"):
        assert key in done.data

    events = stack.events(second)
    assert "regenerate" not in [e.data["stage"] for e in events if e.type == "stage"]
    (reused,) = [e for e in events if e.data and e.data.get("kind") == "regenerate"]
    assert reused.data["reused"] is True and "reusing regenerated data" in reused.message
    prov = json.loads((_regen_dir(stack) / "data.jsonl.provenance.json").read_text())
    assert prov["fingerprint"] == done.data["fingerprint"] == reused.data["fingerprint"]


def test_cancel_during_regeneration_stops_cleanly_and_the_next_job_resumes(
    stack: Stack, toy_verifier_dir: Path, tmp_path: Path
) -> None:
    from service.crud import jobstate

    rows = 240  # fifteen batches of generation: the cancel lands well before the last
    data = write_toy_dataset(tmp_path / "chat.jsonl", n=rows, seed=1)
    spec = toy_spec(toy_verifier_dir, data, dataset={"regenerate": REGEN}, training={"max_steps": 2})
    job_id = stack.submit(spec)
    stack.worker()

    def first_batch_appended() -> bool:
        logs = list(Path(stack.settings.artifact_root).glob("projects/*/regenerated/*/data.jsonl.parts"))
        return bool(logs) and logs[0].read_bytes().count(b"\n") >= 2  # the header and a conversation

    # Cancel as soon as the work log shows progress, while most conversations are still to do. The stage
    # reads the job row before each batch (not only the monitor's flag, which lags by a poll), so the
    # cancel stops it at the next batch however fast this machine generates.
    stack.wait_for("the first regenerated conversations", first_batch_appended, timeout=300, every=0.01)
    with stack.sessions() as s:
        assert jobstate.transition(s, job_id, "cancelling", expect=("running",), event="cancel requested")
    job = stack.wait_status(job_id, "cancelled", "failed", "succeeded", timeout=120)
    assert job.status == "cancelled", [e.message for e in stack.events(job_id)]
    (stopped,) = [e for e in stack.events(job_id) if "regeneration stopped" in e.message]
    done = stopped.data["conversations"]
    assert 0 < done < rows
    progress = stack.job(job_id).progress["regenerate"]  # the stage's progress, flushed before the status
    assert progress["done"] == done and progress["total"] == rows and "eta_s" in progress
    assert not [e for e in stack.events(job_id) if e.type == "stage" and e.data["stage"] == "prepare"]
    work_log = _regen_dir(stack) / "data.jsonl.parts"
    assert work_log.read_bytes().count(b"\n") == done + 1  # header + one line per finished conversation

    again = stack.submit(spec)
    job = stack.wait_status(again, "succeeded", "failed", "cancelled", timeout=600)
    assert job.status == "succeeded", (job.error, [e.message for e in stack.events(again)])
    (resumed,) = [e for e in stack.events(again) if "resuming regeneration" in e.message]
    assert resumed.data["resume_from"] == done
    out = _regen_dir(stack) / "data.jsonl"
    lines = out.read_text().splitlines()
    source = data.read_text().splitlines()
    assert len(lines) == rows and not work_log.exists()
    # every conversation once, in source order: the user turns match the source row for row
    for new, old in zip(lines, source, strict=True):
        users = [[m for m in json.loads(x)["messages"] if m["role"] == "user"] for x in (new, old)]
        assert users[0] == users[1]


def test_a_prompts_only_dataset_trains_with_regeneration_and_fails_naming_the_field_without(
    stack: Stack, toy_verifier_dir: Path, toy_dataset_path: Path, tmp_path: Path
) -> None:
    rows = [json.loads(line) for line in toy_dataset_path.read_text().splitlines()[:24]]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"messages": [m for m in r["messages"] if m["role"] != "assistant"]}) + "\n"
            for r in rows
        )
    )
    regen = toy_spec(toy_verifier_dir, prompts, dataset={"regenerate": REGEN}, training={"max_steps": 2})
    plain = toy_spec(toy_verifier_dir, prompts, training={"max_steps": 2})
    ok, refused = stack.submit(regen), stack.submit(plain)
    stack.run_burst()
    job = stack.job(ok)
    assert job.status == "succeeded", (job.error, [e.message for e in stack.events(ok)])
    (done,) = [e for e in stack.events(ok) if e.data and e.data.get("kind") == "regenerate"]
    assert done.data["written"] == 24 and done.data["turns"] >= 24  # every user turn answered
    job = stack.job(refused)
    assert job.status == "failed" and job.error["code"] == "invalid_data"
    assert "no assistant turn" in job.error["message"] and "dataset.regenerate" in job.error["message"]

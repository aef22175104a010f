"""The dashboard in a real headless Chromium (Debian's, driven by Playwright) against one `peagle up` stack,
one test per page: sign in, upload a dataset, the editor refusing a spec inline, a job page watching a job
succeed with charts holding every metric row the API returns and its checkpoint downloads, the jobs list
live and filtered, cancelling from a job page, compare, and another project's ids answering 404. No console
errors on any page. The stack and its three jobs (submitted from the editor) are module fixtures, so the
tests share one set of training runs.

Screenshots of the jobs list, a job page and the compare view land in `test-output/ui/`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from client import PeagleClient
from client.sdk import TERMINAL_STATUSES
from tests.cli.test_up import Up
from tests.fixtures.archives import extract_archive

pytestmark = pytest.mark.slow
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is a dev dependency")

CHROMIUM = Path(os.environ.get("PEAGLE_TEST_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SHOTS = Path(__file__).resolve().parents[2] / "test-output" / "ui"
JOB_TIMEOUT_MS = 300_000

if not CHROMIUM.exists():
    pytest.skip(f"no Chromium at {CHROMIUM} (.ci/run installs Debian's `chromium`)", allow_module_level=True)


def job_yaml(
    verifier: Path, dataset_id: str, name: str, *, lr: float, max_steps: int, seed: int = 0, epochs: int = 1
) -> str:
    """A test-size job as a user would type it in the editor."""
    return f"""\
name: {name}
verifier:
  name_or_path: {verifier}
dataset:
  id: {dataset_id}
  seq_len: 128
  val_fraction: 0.1
hidden_states:
  mode: online
model:
  num_layers: 1
  num_depths: 2
  draft_vocab_size: 256
training:
  epochs: {epochs}
  total_seq_len: 256
  lr: {lr}
  max_steps: {max_steps}
  checkpoint_every_steps: {max_steps}
  eval_every_steps: 4
  seed: {seed}
evaluation:
  prompts: 2
  max_new_tokens: 8
  engine: peagle          # vLLM's own figures are tests/integration's; here they would only add engine starts
export:
  vllm_check: false
"""


class Console:
    """Console errors and uncaught exceptions of every page opened in a context."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def watch(self, page: Any) -> Any:
        page.on("console", lambda m: m.type == "error" and self.errors.append(f"{page.url}: {m.text}"))
        page.on("pageerror", lambda e: self.errors.append(f"{page.url}: uncaught {e}"))
        return page


class Jobs(NamedTuple):
    """The module's three jobs, queued in this order on the one worker: two to compare, one long one to
    cancel."""

    first: str
    second: str
    long: str


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory, toy_verifier_dir: Path) -> Iterator[Up]:
    """One `peagle up` (SQLite, embedded Redis, one worker) for every browser test in this module."""
    tmp = tmp_path_factory.mktemp("ui-up")
    drop = ("PEAGLE_URL", "PEAGLE_API_KEY", "PEAGLE_DATABASE_URL", "PEAGLE_REDIS_URL", "PEAGLE_ARTIFACT_ROOT")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(
        PEAGLE_CACHE_DIR=str(tmp / "cache"),
        PEAGLE_DATA_DIR="/nonexistent-peagle-data",
        PEAGLE_ALLOWED_MODEL_ROOTS=str(toy_verifier_dir.parent),
    )
    stack = Up(tmp / "data", env)
    try:
        yield stack
        # Nothing the tests did made the server fail (SSE disconnects, downloads, forms).
        log = (stack.data_dir / "logs" / "api.log").read_text()
        assert "Traceback" not in log, log[log.index("Traceback") :][:4000]
    finally:
        stack.kill()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def client(up: Up) -> Iterator[PeagleClient]:
    with PeagleClient(up.url, up.key) as c:
        yield c


@pytest.fixture(scope="module")
def session(browser: Any, up: Up) -> Iterator[Any]:
    """One browser context signed in with the stack's key: the module's pages share its cookie."""
    context = browser.new_context(accept_downloads=True, viewport={"width": 1400, "height": 1000})
    first = context.new_page()
    sign_in(first, up.url, up.key)
    first.close()
    yield context
    context.close()


@contextlib.contextmanager
def tab(session: Any, url: str) -> Iterator[Any]:
    """A new page of the signed-in session, opened on the jobs list; no console errors on it."""
    console = Console()
    page = console.watch(session.new_page())
    page.set_default_timeout(30_000)
    try:
        page.goto(f"{url}/ui/")
        yield page
    finally:
        page.close()
    assert console.errors == []


@pytest.fixture
def page(session: Any, up: Up) -> Iterator[Any]:
    SHOTS.mkdir(parents=True, exist_ok=True)
    with tab(session, up.url) as p:
        yield p


@pytest.fixture(scope="module")
def dataset(client: PeagleClient, toy_dataset_path: Path) -> dict[str, Any]:
    """The toy dataset the jobs train on (uploaded through the API; the upload form has its own test)."""
    return client.upload_dataset(toy_dataset_path)


@pytest.fixture(scope="module")
def jobs(session: Any, up: Up, dataset: dict[str, Any], toy_verifier_dir: Path) -> Jobs:
    """Three jobs submitted from the editor, as a user would; the worker runs them while the tests watch."""
    specs = (
        job_yaml(toy_verifier_dir, dataset["id"], "ui-first", lr=0.002, max_steps=8),
        job_yaml(toy_verifier_dir, dataset["id"], "ui-second", lr=0.0005, max_steps=8, seed=1),
        job_yaml(toy_verifier_dir, dataset["id"], "ui-long", lr=0.001, max_steps=5000, epochs=300),
    )
    with tab(session, up.url) as editor:
        return Jobs(*(submit_from_editor(editor, up.url, spec) for spec in specs))


@pytest.fixture(scope="module")
def first_checkpoint(client: PeagleClient, jobs: Jobs) -> dict[str, Any]:
    """The first job's published checkpoint, once it has succeeded."""
    job = client.wait(jobs.first, timeout_s=JOB_TIMEOUT_MS / 1000)
    assert job["status"] == "succeeded", job["error"]
    (ckpt,) = client.list_checkpoints(jobs.first)["data"]
    return ckpt


def sign_in(page: Any, url: str, key: str) -> None:
    page.goto(f"{url}/")
    assert "/ui/login" in page.url  # signed out: the root redirects to the dashboard's sign-in
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(f"{url}/ui/")


def submit_from_editor(page: Any, url: str, text: str) -> str:
    page.goto(f"{url}/ui/jobs/new")
    page.get_by_label("Job spec (YAML)", exact=False).fill(text)
    page.get_by_role("button", name="Submit job").click()
    page.wait_for_url(re.compile(r".*/ui/jobs/job_[0-9a-f]+$"))
    return page.url.rsplit("/", 1)[-1]


def chart_points(page: Any, chart: str) -> list[int]:
    return page.evaluate(f"() => (document.getElementById('{chart}').data || []).map(t => t.x.length)")


def api_rows(client: PeagleClient, job_id: str, key: str) -> int:
    """How many metric rows of the job the API returns with `key` (every page)."""
    return sum(1 for r in client.job_metrics(job_id) if r["values"].get(key) is not None)


def test_sign_in_refuses_a_wrong_key_and_opens_the_jobs_list(up: Up, browser: Any) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    console = Console()
    context = browser.new_context()
    page = console.watch(context.new_page())
    page.goto(f"{up.url}/")
    assert "/ui/login" in page.url
    page.get_by_label("API key").fill("peagle_sk_not-a-key")
    page.get_by_role("button", name="Sign in").click()
    assert "unknown or revoked" in page.get_by_role("alert").inner_text()
    page.screenshot(path=str(SHOTS / "login.png"))
    page.get_by_label("API key").fill(up.key)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(f"{up.url}/ui/")
    assert page.get_by_role("heading", name="Jobs").is_visible()
    context.close()
    assert console.errors == []


def test_datasets_page_uploads_with_progress(
    page: Any, up: Up, client: PeagleClient, toy_dataset_path: Path
) -> None:
    before = {d["id"] for d in client.list_datasets()["data"]}
    page.get_by_role("link", name="Datasets").click()
    page.get_by_label("Chat data", exact=False).set_input_files(str(toy_dataset_path))
    page.get_by_role("button", name="Upload").click()
    page.wait_for_selector("#upload-result:has-text('Uploaded')")
    assert page.eval_on_selector("#upload-progress", "p => p.value") == 100
    (uploaded,) = [d for d in client.list_datasets()["data"] if d["id"] not in before]
    assert uploaded["num_records"] == 64
    page.wait_for_selector(f"tr[data-dataset-id='{uploaded['id']}']")
    page.screenshot(path=str(SHOTS / "datasets.png"), full_page=True)


def test_editor_refuses_an_invalid_spec_at_its_line(
    page: Any, up: Up, client: PeagleClient, dataset: dict[str, Any], toy_verifier_dir: Path
) -> None:
    bad = job_yaml(toy_verifier_dir, dataset["id"], "ui-bad", lr=0.002, max_steps=8).replace(
        "lr: 0.002", "lr: -1"
    )
    before = len(list(client.iter_jobs()))
    page.goto(f"{up.url}/ui/jobs/new")
    page.get_by_label("Job spec (YAML)", exact=False).fill(bad)
    page.get_by_role("button", name="Submit job").click()
    error = page.locator(".field-error[data-param='training.lr']")
    lr_line = bad.splitlines().index("  lr: -1") + 1
    assert error.get_attribute("data-line") == str(lr_line)
    assert "greater than 0" in error.inner_text()
    assert page.locator(".gutter .bad").inner_text() == str(lr_line)
    assert page.get_by_label("Job spec (YAML)", exact=False).get_attribute("aria-invalid") == "true"
    assert len(list(client.iter_jobs())) == before  # nothing was created
    page.screenshot(path=str(SHOTS / "editor-error.png"), full_page=True)


def test_job_page_follows_a_job_to_success(page: Any, up: Up, client: PeagleClient, jobs: Jobs) -> None:
    page.goto(f"{up.url}/ui/jobs/{jobs.first}")
    page.wait_for_selector("#job-status[data-status='succeeded']", timeout=JOB_TIMEOUT_MS)
    # Its charts hold every point the metrics API returns.
    want_loss = api_rows(client, jobs.first, "loss")
    want_eval = api_rows(client, jobs.first, "eval/acceptance_length@2")
    assert want_loss == 8 and want_eval == 2
    page.wait_for_function(
        f"() => document.getElementById('chart-loss')?.data?.[0]?.x.length === {want_loss}"
    )
    assert chart_points(page, "chart-loss") == [want_loss]
    assert chart_points(page, "chart-acc") == [
        api_rows(client, jobs.first, "acc_0"),
        api_rows(client, jobs.first, "acc_1"),
    ]
    assert chart_points(page, "chart-tps") == [api_rows(client, jobs.first, "tokens_per_s")]
    assert chart_points(page, "chart-lr") == [api_rows(client, jobs.first, "lr")]
    assert chart_points(page, "chart-al") == [want_eval]
    stages = page.locator("ol.timeline li strong").all_inner_texts()
    assert stages[:1] == ["prepare"] and "train" in stages and "export" in stages
    page.wait_for_selector("#events li:has-text('succeeded')")
    (ckpt,) = client.list_checkpoints(jobs.first)["data"]
    command = page.locator(f"#cmd-{ckpt['id']}").inner_text()
    assert command.startswith("VLLM_USE_V2_MODEL_RUNNER=0 vllm serve") and f"./{ckpt['id']}" in command
    page.get_by_role("button", name="Copy command").click()
    page.wait_for_selector(".copied:not(:empty)")
    page.screenshot(path=str(SHOTS / "job.png"), full_page=True)


def test_job_page_downloads_match_the_checkpoint(
    page: Any, up: Up, jobs: Jobs, first_checkpoint: dict[str, Any], tmp_path: Path
) -> None:
    ckpt = first_checkpoint
    page.goto(f"{up.url}/ui/jobs/{jobs.first}")
    # The whole archive: every file's sha256 matches the listing, and so does the manifest.
    with page.expect_download() as info:
        page.get_by_role("link", name="Download all (.tar)").click()
    archive = tmp_path / "ckpt.tar"
    info.value.save_as(archive)
    with tarfile.open(archive) as tar:
        extract_archive(tar, tmp_path / "ckpt")
    for f in ckpt["files"]:
        got = hashlib.sha256((tmp_path / "ckpt" / ckpt["id"] / f["name"]).read_bytes()).hexdigest()
        assert got == f["sha256"], f["name"]
        assert page.locator(f"tr:has-text('{f['name']}') code.hash").first.inner_text() == f["sha256"]
    from service.artifacts import manifest_sha256

    assert manifest_sha256(ckpt["files"]) == ckpt["sha256"]
    # One file.
    with page.expect_download() as info:
        page.get_by_role("link", name="model.safetensors").click()
    weights = next(f for f in ckpt["files"] if f["name"] == "model.safetensors")
    assert hashlib.sha256(Path(info.value.path()).read_bytes()).hexdigest() == weights["sha256"]


def test_jobs_list_follows_a_running_job_live(page: Any, up: Up, jobs: Jobs) -> None:
    # The page opens on the jobs list: the long job's step moves on without a reload.
    row = f"#jobs tr[data-job-id='{jobs.long}']"
    page.wait_for_selector(f"{row}[data-status='running']:not([data-step='0'])", timeout=JOB_TIMEOUT_MS)
    seen = page.get_attribute(row, "data-step")
    page.wait_for_selector(f"{row}[data-status='running']:not([data-step='{seen}'])", timeout=JOB_TIMEOUT_MS)


def test_job_page_cancels_a_running_job(page: Any, up: Up, client: PeagleClient, jobs: Jobs) -> None:
    page.goto(f"{up.url}/ui/jobs/{jobs.long}")
    page.wait_for_selector("#job-status[data-status='running']", timeout=JOB_TIMEOUT_MS)
    page.wait_for_function(
        "() => document.getElementById('chart-loss')?.data?.[0]?.x.length > 0", timeout=JOB_TIMEOUT_MS
    )
    page.get_by_role("button", name="Cancel job").click()
    # Any end state ends the wait, so a job that failed instead says so at once, with its error.
    ended = ", ".join(f"#job-status[data-status='{s}']" for s in ("cancelled", "failed", "succeeded"))
    page.wait_for_selector(ended, timeout=JOB_TIMEOUT_MS)
    assert client.get_job(jobs.long)["status"] == "cancelled", client.get_job(jobs.long)["error"]


def test_compare_page_overlays_two_jobs(page: Any, up: Up, client: PeagleClient, jobs: Jobs) -> None:
    for job_id in (jobs.first, jobs.second):
        job = client.wait(job_id, timeout_s=JOB_TIMEOUT_MS / 1000)
        assert job["status"] == "succeeded", job["error"]
    page.get_by_role("link", name="Compare").first.click()
    page.get_by_label("ui-first", exact=False).check()
    page.get_by_label("ui-second", exact=False).check()
    page.get_by_role("button", name="Compare").click()
    page.wait_for_function("() => (document.getElementById('chart-compare')?.data || []).length === 2")
    want = [api_rows(client, jobs.first, "loss"), api_rows(client, jobs.second, "loss")]
    assert chart_points(page, "chart-compare") == want
    page.get_by_label("Metric", exact=True).select_option("eval")
    page.wait_for_function(
        "() => document.getElementById('chart-compare')?.data?.every(t => t.name.includes('ours K=2'))"
    )
    page.get_by_label("Metric", exact=True).select_option("loss")
    page.screenshot(path=str(SHOTS / "compare.png"), full_page=True)


def test_jobs_list_shows_status_in_words_and_filters(
    page: Any, up: Up, client: PeagleClient, jobs: Jobs
) -> None:
    for job_id in (jobs.first, jobs.second):
        client.wait(job_id, timeout_s=JOB_TIMEOUT_MS / 1000)
    page.reload()
    assert page.locator("#jobs tbody tr").count() == 3
    for job_id in jobs:
        status = client.get_job(job_id)["status"]
        if status in TERMINAL_STATUSES:  # a running one may move on between the two reads
            text = page.locator(f"tr[data-job-id='{job_id}'] .status").inner_text()
            assert text.strip().endswith(status), (job_id, text)
    page.screenshot(path=str(SHOTS / "jobs.png"), full_page=True)
    page.get_by_label("Status").select_option("succeeded")
    page.wait_for_url(re.compile(r".*status=succeeded"))
    rows = page.locator("#jobs tbody tr").all()
    assert {r.get_attribute("data-status") for r in rows} == {"succeeded"}
    assert {jobs.first, jobs.second} <= {r.get_attribute("data-job-id") for r in rows}


def test_another_project_sees_none_of_it(
    up: Up, browser: Any, jobs: Jobs, first_checkpoint: dict[str, Any]
) -> None:
    """Another project's key: its jobs list is empty, and every page and download answers 404."""
    from service.crud.projects import create_key
    from service.db.session import session_scope

    with session_scope(f"sqlite:///{up.data_dir / 'peagle.db'}") as s:
        other_key, _ = create_key(s, "someone-else")
    other = browser.new_context()
    try:
        intruder = other.new_page()
        sign_in(intruder, up.url, other_key)
        assert intruder.locator("#jobs tbody tr[data-job-id]").count() == 0
        response = intruder.goto(f"{up.url}/ui/jobs/{jobs.first}")
        assert response.status == 404 and "Not found" in intruder.content()
        ckpt = first_checkpoint["id"]
        for path in (
            f"/ui/checkpoints/{ckpt}/archive",
            f"/ui/checkpoints/{ckpt}/files/model.safetensors",
            f"/ui/data/jobs/{jobs.first}/metrics",
            f"/ui/compare?job={jobs.first}",
        ):
            assert other.request.get(f"{up.url}{path}").status == 404, path
    finally:
        other.close()

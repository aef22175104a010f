"""Server paths in a spec: file:// normalised, ~ refused, the service's own data unreachable, a cache never a
whole root nor over other projects' files, per-project files areas, and `peagle up`'s roots."""

from __future__ import annotations

from pathlib import Path

import pytest

from peagle_core.spec import SpecError, parse_spec
from service.paths import check_spec_paths


@pytest.fixture
def paths_settings(make_settings, tmp_path: Path):
    # One wide allowed root that also holds the service's data dir and a per-project files area.
    return make_settings(
        allowed_data_roots=[tmp_path, tmp_path / "shared"],
        allowed_model_roots=[tmp_path],
        project_files_root=tmp_path / "projects",
    )


def _spec(verifier: Path, **dataset: str) -> dict:
    return {"verifier": {"name_or_path": str(verifier)}, "dataset": {"seq_len": 64, **dataset}}


def _check(settings, spec: dict, project: str = "proj_a"):
    return check_spec_paths(parse_spec(spec), settings, project_id=project)


def _param(settings, spec: dict, project: str = "proj_a") -> str:
    with pytest.raises(SpecError) as info:
        _check(settings, spec, project)
    return info.value.errors[0][0] + ": " + info.value.errors[0][1]


def test_file_uris_are_normalised_and_tilde_refused(paths_settings, tmp_path: Path) -> None:
    model = tmp_path / "models" / "v"
    model.mkdir(parents=True)
    data = tmp_path / "d" / "chat.jsonl"
    data.parent.mkdir()
    data.write_text("{}\n")
    (tmp_path / "link").symlink_to(data.parent)
    spec = _check(
        paths_settings, _spec(Path(f"file://{model}"), path=f"file://{tmp_path}/link/../d/chat.jsonl")
    )
    assert spec.verifier.name_or_path == str(model) and spec.dataset.path == str(data)
    spec = _check(paths_settings, _spec(model, path=f"file://localhost{tmp_path}/link/chat.jsonl"))
    assert spec.dataset.path == str(data)  # the symlink is resolved: the worker uses what was checked
    init = {**_spec(model, path=str(data)), "model": {"init_from": f"file://{tmp_path}/models/../models/v"}}
    assert _check(paths_settings, init).model.init_from == str(model)
    assert "not expanded" in _param(paths_settings, _spec(model, path="~/chat.jsonl"))
    assert "only file:///" in _param(paths_settings, _spec(model, path=f"file://evil.example{data}"))
    assert "verifier.name_or_path" in _param(paths_settings, _spec(Path("~root/models"), path=str(data)))


def test_service_state_and_other_projects_are_unreachable(paths_settings, tmp_path: Path) -> None:
    model = tmp_path / "models" / "v"
    model.mkdir(parents=True)
    data_dir = Path(paths_settings.data_dir)
    (data_dir / "artifacts" / "datasets" / "ds_x").mkdir(parents=True)
    secret = data_dir / "artifacts" / "datasets" / "ds_x" / "data.jsonl"
    secret.write_text("{}\n")
    (data_dir / "api-key").write_text("k")
    for target in (secret, data_dir / "api-key", data_dir / "peagle.db"):
        target.touch()
        assert "service's own data" in _param(paths_settings, _spec(model, path=str(target)))
    own = tmp_path / "projects" / "proj_a" / "chat.jsonl"
    own.parent.mkdir(parents=True)
    own.write_text("{}\n")
    assert _check(paths_settings, _spec(model, path=str(own))).dataset.path == str(own)
    with pytest.raises(SpecError):  # the same file is another project's
        _check(paths_settings, _spec(model, path=str(own)), project="proj_b")

    def cache(uri: Path, project: str = "proj_a") -> str:
        return _param(
            paths_settings, {**_spec(model, path=str(own)), "hidden_states": {"cache_uri": str(uri)}}, project
        )

    (tmp_path / "shared").mkdir()
    assert "files area" in cache(tmp_path / "shared")  # a shared data root: other projects read there
    assert "files area" in cache(tmp_path / "shared" / "sub")
    assert "service's own data" in cache(tmp_path)  # it would contain the data dir
    assert "outside this project's own directory" in cache(tmp_path / "projects")
    assert "outside this project's own directory" in cache(tmp_path / "projects" / "proj_a", "proj_b")
    assert "not the area itself" in cache(tmp_path / "projects" / "proj_a")
    assert "service's own data" in cache(data_dir / "artifacts" / "checkpoints")


@pytest.fixture
def cache_settings(make_settings, tmp_path: Path):
    # Models, shared data and per-project files side by side, as an operator lays them out.
    for d in ("models", "shared", "projects"):
        (tmp_path / d).mkdir()
    # One model root inside a project's area: whatever is there, other projects may load it.
    (tmp_path / "projects" / "proj_a" / "published").mkdir(parents=True)
    return make_settings(
        allowed_data_roots=[tmp_path / "shared"],
        allowed_model_roots=[tmp_path / "models", tmp_path / "projects" / "proj_a" / "published"],
        project_files_root=tmp_path / "projects",
    )


@pytest.mark.parametrize("marker", ["config.json", "tokenizer.json", "model-00001-of-00002.safetensors"])
def test_a_cache_never_lands_in_a_model(cache_settings, tmp_path: Path, marker: str) -> None:
    """No project writes where another reads: a cache inside a model root, or inside any directory that
    holds a model (its files in the directory or an ancestor), is refused naming the field."""
    model = tmp_path / "models" / "v"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = tmp_path / "shared" / "chat.jsonl"
    data.write_text("{}\n")
    area = tmp_path / "projects" / "proj_a"

    def cache(uri: Path) -> str:
        return _param(
            cache_settings, {**_spec(model, path=str(data)), "hidden_states": {"cache_uri": str(uri)}}
        )

    assert cache(model).startswith("spec.hidden_states.cache_uri: ")  # a verifier is nobody's cache
    assert "model root" in cache(area / "published" / "cache")
    assert "model root" in cache(area / "published")
    # A model the project keeps in its own area (e.g. to use as init_from elsewhere) is no cache either.
    own_model = area / "m"
    (own_model / "sub").mkdir(parents=True)
    (own_model / marker).write_text("{}")
    assert "holding a model" in cache(own_model)
    assert "holding a model" in cache(own_model / "sub" / "cache")
    # A cache directory that already holds its own shards is fine (a rerun reuses it).
    filled = area / "hs"
    filled.mkdir()
    (filled / "manifest.json").write_text("{}")
    (filled / "shard-00000.safetensors").write_bytes(b"")
    ok = {**_spec(model, path=str(data)), "hidden_states": {"cache_uri": f"file://{filled}"}}
    assert _check(cache_settings, ok).hidden_states.cache_uri == str(filled)


def test_the_api_refuses_a_cache_in_the_verifier_with_422(client, auth, spec) -> None:
    body = {**spec, "hidden_states": {"cache_uri": spec["verifier"]["name_or_path"] + "/cache"}}
    r = client.post("/v1/jobs", json={"spec": body}, headers=auth)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == "spec.hidden_states.cache_uri"


def test_api_stores_normalised_paths(client, auth, spec) -> None:
    body = {**spec, "dataset": {**spec["dataset"], "path": "file://" + spec["dataset"]["path"]}}
    r = client.post("/v1/jobs", json={"spec": body}, headers=auth)
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["dataset"]["path"] == str(Path(spec["dataset"]["path"]).resolve())
    r = client.post(
        "/v1/jobs", json={"spec": {**spec, "dataset": {"path": "~/x.jsonl", "seq_len": 64}}}, headers=auth
    )
    assert r.status_code == 422 and r.json()["error"]["param"] == "spec.dataset.path"


def test_peagle_up_roots_exclude_its_data_dir(tmp_path: Path, monkeypatch) -> None:
    from cli.embedded import EmbeddedStack
    from service.settings import Settings

    data_dir = tmp_path / "up"
    data_dir.mkdir()
    env = EmbeddedStack(data_dir=data_dir.resolve())._child_env("redis://127.0.0.1:1/0")
    for name, value in env.items():
        if name.startswith("PEAGLE_"):
            monkeypatch.setenv(name, value)
    settings = Settings()
    (data_dir / "models" / "v").mkdir(parents=True)
    (data_dir / "api-key").write_text("k")
    (data_dir / "peagle.db").write_text("")
    own = data_dir / "projects" / "proj_a" / "chat.jsonl"
    own.parent.mkdir(parents=True)
    own.write_text("{}\n")
    model = data_dir / "models" / "v"
    for target in (data_dir / "api-key", data_dir / "peagle.db"):
        with pytest.raises(SpecError):
            _check(settings, _spec(model, path=str(target)))
    assert _check(settings, _spec(model, path=str(own))).dataset.path == str(own)
    with pytest.raises(SpecError):
        _check(settings, _spec(model, path=str(own)), project="proj_b")

"""The deploy files and the README agree with the code: compose commands, env vars and ports exist;
the README documents every job-spec field (with its real default) and every setting."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from pydantic import BaseModel

from cli import build_app
from peagle_core.spec import JobSpec
from service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def cli() -> Any:
    return typer.main.get_command(build_app())


def resolve_command(cli: Any, argv: list[str]) -> tuple[Any, list[str]]:
    """Walk `peagle sub sub ...` down the command tree; returns the leaf command and its arguments."""
    cmd = cli
    args = list(argv)
    # Groups have `.commands` (typer vendors its own click, so no isinstance against click's classes).
    while hasattr(cmd, "commands") and args and not args[0].startswith("-"):
        name = args.pop(0)
        sub = cmd.commands.get(name)
        assert sub is not None, f"`peagle {' '.join(argv)}`: no subcommand {name!r}"
        cmd = sub
    assert not hasattr(cmd, "commands"), f"`peagle {' '.join(argv)}` names a group, not a command"
    return cmd, args


def service_env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def test_compose_has_the_production_services(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"postgres", "redis", "migrate", "api", "worker"} <= set(services)
    for name in ("postgres", "redis", "api"):
        assert "healthcheck" in services[name], f"{name} has no health check"
    assert services["migrate"]["command"] == ["peagle", "db", "upgrade"]
    for name in ("api", "worker"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert {"pgdata", "artifacts"} <= set(compose["volumes"])
    assert any(v.startswith("pgdata:") for v in services["postgres"]["volumes"])
    assert any(v.startswith("artifacts:") for v in services["api"]["volumes"])
    assert any(v.startswith("artifacts:") for v in services["worker"]["volumes"])
    assert services["worker"]["build"]["target"] == "worker"  # the image with vLLM (the publish gate)
    assert services["api"]["build"]["target"] == "api"


def test_compose_commands_exist_in_the_cli(compose: dict[str, Any], cli: Any) -> None:
    peagle_services = [s for s in compose["services"].values() if (s.get("command") or [""])[0] == "peagle"]
    assert len(peagle_services) >= 3
    for service in peagle_services:
        cmd, args = resolve_command(cli, service["command"][1:])
        known = {opt for p in cmd.params for opt in (*p.opts, *p.secondary_opts)}
        for arg in args:
            if arg.startswith("--"):
                assert arg.split("=")[0] in known, f"{service['command']}: `{cmd.name}` has no option {arg}"


def test_compose_env_vars_are_settings(compose: dict[str, Any]) -> None:
    fields = {f"PEAGLE_{name.upper()}" for name in Settings.model_fields}
    seen = set()
    for name, service in compose["services"].items():
        for var in service_env(service):
            if var.startswith("PEAGLE_"):
                assert var in fields, f"service {name}: {var} is not a field of service.settings.Settings"
                seen.add(var)
    assert {"PEAGLE_DATABASE_URL", "PEAGLE_REDIS_URL", "PEAGLE_ARTIFACT_ROOT"} <= seen
    # The containers reach each other by service name.
    env = service_env(compose["services"]["api"])
    assert "@postgres:5432/" in env["PEAGLE_DATABASE_URL"]
    assert env["PEAGLE_REDIS_URL"].startswith("redis://redis:6379")


def test_env_example_names_only_real_settings() -> None:
    fields = {f"PEAGLE_{name.upper()}" for name in Settings.model_fields}
    names = re.findall(r"^#?\s*(PEAGLE_[A-Z_]+)=", (ROOT / ".env.example").read_text(), flags=re.M)
    assert names
    assert set(names) <= fields


def test_api_port_matches_its_command_and_health_check(compose: dict[str, Any]) -> None:
    api = compose["services"]["api"]
    command = api["command"]
    port = command[command.index("--port") + 1]
    container_ports = {p.rsplit(":", 1)[-1] for p in api["ports"]}
    assert container_ports == {port}
    assert f":{port}/" in " ".join(api["healthcheck"]["test"])


def test_dockerfile_installs_the_project() -> None:
    text = (ROOT / "Dockerfile").read_text()
    froms = [line for line in text.splitlines() if line.startswith("FROM")]
    assert froms == ["FROM python:3.11-slim AS api", "FROM api AS worker"]
    assert re.search(r'^RUN pip install "?\.(\[[a-z,-]+\])?"?$', text, flags=re.M)
    # The worker image carries the vLLM the serving tests pin, so the publish gate runs in production.
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f"ARG VLLM_PACKAGE={dev['vllm'][0]}" in text
    assert dev["vllm"][0].split("==")[1] in " ".join(dev["dev"])
    copied = re.findall(r"^COPY (\S+)", text, flags=re.M)
    for path in copied:
        assert (ROOT / path).exists(), f"Dockerfile copies {path}, which does not exist"
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    missing = {p.rstrip("*") for p in packages["find"]["include"]} - set(copied)
    assert not missing, f"the image would lack the packages {sorted(missing)}"


# -- README --------------------------------------------------------------------------------------


def spec_fields(model: type[BaseModel] = JobSpec, prefix: str = "") -> dict[str, str]:
    """Every leaf field of the job spec as dotted path -> its default as the README writes it."""
    out = {}
    # Defaults as the spec serialises them (a field serializer may spell `None` as the user writes it).
    dumped = model.model_construct().model_dump(mode="json")
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.update(spec_fields(ann, f"{prefix}{name}."))
        elif field.is_required():
            out[prefix + name] = "required"
        else:
            out[prefix + name] = f"`{json.dumps(dumped[name])}`"
    return out


def readme_table(text: str, heading: str) -> dict[str, str]:
    section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \| ([^|]+) \|", section, flags=re.M)
    return {name: default.strip() for name, default in rows}


def test_readme_documents_every_spec_field_with_its_default() -> None:
    documented = readme_table((ROOT / "README.md").read_text(), "Job spec reference")
    assert documented == spec_fields()


def test_readme_documents_every_setting() -> None:
    documented = readme_table((ROOT / "README.md").read_text(), "Settings")
    assert set(documented) == {f"PEAGLE_{name.upper()}" for name in Settings.model_fields}


def test_readme_starts_with_the_two_commands_and_ci_runs_the_second() -> None:
    blocks = re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S)
    demo, tests = blocks[0], blocks[1]
    assert demo.endswith("peagle demo")
    assert tests in (ROOT / ".ci" / "run").read_text()
    cmd, _ = resolve_command(typer.main.get_command(build_app()), ["demo"])
    assert cmd.name == "demo"

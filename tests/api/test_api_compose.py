"""compose.yaml: the services, their healthchecks and wiring; `docker compose config` validates it where the docker
client has the compose plugin (no engine is needed for that)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
ROOT = Path(__file__).resolve().parents[2]
LONG_RUNNING = ("redis", "postgres", "api", "gpu-worker", "webhooks-worker", "prometheus")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_services_and_healthchecks(compose):
    services = compose["services"]
    assert set(services) == {"migrate", *LONG_RUNNING}
    for name in LONG_RUNNING:
        assert services[name]["healthcheck"]["test"], name
    assert "--appendonly yes" in " ".join(services["redis"]["command"])
    assert "--maxmemory-policy noeviction" in " ".join(services["redis"]["command"])
    assert any(v.endswith(":/var/lib/postgresql/data") for v in services["postgres"]["volumes"])
    assert services["migrate"]["command"] == ["sluice", "db", "upgrade"] and services["migrate"]["restart"] == "no"
    assert services["api"]["depends_on"]["migrate"] == {"condition": "service_completed_successfully"}
    assert "/readyz" in " ".join(services["api"]["healthcheck"]["test"])


def test_gpu_worker_webhooks_worker_and_prometheus(compose):
    services = compose["services"]
    gpu = services["gpu-worker"]
    assert gpu["command"][:3] == ["sluice", "worker", "--model"] and gpu["command"][3].startswith("/models/")
    assert any(v.endswith(":/models:ro") for v in gpu["volumes"])
    [device] = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and device["count"] == 1
    # Docker gives every replica of a `count: 1` reservation the host's first GPU: one GPU worker per service
    assert "replicas" not in gpu["deploy"]
    assert gpu["build"]["args"]["EXTRAS"] == "gpu"
    webhooks = services["webhooks-worker"]["command"]
    assert webhooks[:7] == ["celery", "-A", "sluice.worker.celery_app", "worker", "-Q", "webhooks,maintenance", "-B"]
    # beat writes its schedule file; the image's user cannot write its working directory (/app, root's)
    assert webhooks[webhooks.index("--schedule-filename") + 1].startswith("/tmp/")
    assert "USER sluice" in (ROOT / "Dockerfile").read_text()
    mounted = [v.split(":")[0] for v in services["prometheus"]["volumes"]]
    assert "./deploy/prometheus.yml" in mounted
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    assert config["scrape_configs"][0]["static_configs"][0]["targets"] == ["api:8000"]
    workers = config["scrape_configs"][1]["dns_sd_configs"][0]
    assert workers["names"] == ["gpu-worker"] and workers["port"] == 9400
    assert gpu["command"][gpu["command"].index("--metrics-port") + 1] == "9400"
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "FROM python:3.11-slim" in dockerfile and "torch==2.13.0" in dockerfile


def _compose_plugin() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _compose_plugin(), reason="no docker client with the compose plugin")
def test_docker_compose_config_validates():
    result = subprocess.run(["docker", "compose", "-f", "compose.yaml", "config", "--quiet"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_sluice_commands_parse(compose):
    """Every `sluice` command the services run has the flags `sluice <cmd> --help` lists (a wrong one exits 2)."""
    from sluice.worker.cli import build_parser

    parser = build_parser()
    commands = [service["command"] for service in compose["services"].values()
                if service.get("command", [None])[0] == "sluice"]
    assert len(commands) == 3
    for command in commands:
        parser.parse_args(command[1:])

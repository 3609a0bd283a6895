"""compose.yaml / compose.test.yaml: valid for docker-compose 1.29, and every setting reaches the containers."""

from __future__ import annotations

import shutil
import subprocess

import yaml

from mmcpu.config import REPO_ROOT, Settings

# Fixed inside the containers (ports, in-container URLs and paths), so compose must not pass them through.
CONTAINER_FIXED = {"host", "port", "audio_port", "vision_port", "audio_url", "vision_url", "cache_dir", "models_dir"}


def load(name: str) -> dict:
    return yaml.safe_load((REPO_ROOT / name).read_text())


def test_every_setting_is_passed_to_every_service():
    wanted = {f"MMCPU_{name.upper()}" for name in Settings.model_fields} - {
        f"MMCPU_{name.upper()}" for name in CONTAINER_FIXED
    }
    services = load("compose.yaml")["services"]
    assert set(services) == {"audio", "vision", "gateway"}
    for name, service in services.items():
        env = {k for k in service["environment"] if k.startswith("MMCPU_")}
        assert wanted <= env, f"{name} lacks {sorted(wanted - env)}"


def test_gateway_waits_for_healthy_engines_and_publishes_8000():
    gateway = load("compose.yaml")["services"]["gateway"]
    assert gateway["depends_on"] == {s: {"condition": "service_healthy"} for s in ("audio", "vision")}
    assert gateway["environment"]["MMCPU_AUDIO_URL"] == "http://audio:8001"
    assert gateway["environment"]["MMCPU_VISION_URL"] == "http://vision:8002"
    assert any(str(p).endswith(":8000") for p in gateway["ports"])


def test_docker_compose_1_29_accepts_both_files():
    tool = shutil.which("docker-compose")
    assert tool, "docker-compose is not installed (apt-get install docker-compose)"
    result = subprocess.run(
        [tool, "-f", "compose.yaml", "-f", "compose.test.yaml", "config", "--services"],
        cwd=REPO_ROOT, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr
    assert set(result.stdout.split()) == {"audio", "vision", "gateway", "smoke"}

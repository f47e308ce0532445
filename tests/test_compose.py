"""docker-compose.yml and docker/Dockerfile: valid Compose, one image lineage (one Python, one Ray) for
the head and the workers, healthchecks, restart policies, shared volumes, Ray token auth, one worker per
GPU set. Checked without Docker: the development machines and CI have no `docker compose`."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
SCHEMA = Path(__file__).resolve().parent / "data" / "compose-spec.json"
FOLDTUNE_SERVICES = ("api", "runner")


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _gpu_workers(compose: dict) -> dict[str, dict]:
    return {name: s for name, s in compose["services"].items() if name.startswith("gpu-worker")}


def test_the_compose_file_follows_the_compose_specification():
    errors = sorted(jsonschema.Draft7Validator(json.loads(SCHEMA.read_text())).iter_errors(_compose()),
                    key=lambda e: list(e.path))
    assert [f"{list(e.path)}: {e.message}" for e in errors] == []


def test_the_schema_check_catches_a_misspelt_key():
    broken = _compose()
    broken["services"]["runner"]["healthcheck"]["intervall"] = "5s"
    broken["services"]["api"]["ports"] = "8321"
    assert len(list(jsonschema.Draft7Validator(json.loads(SCHEMA.read_text())).iter_errors(broken))) == 2


@pytest.mark.skipif(not shutil.which("docker") or subprocess.run(["docker", "compose", "version"],
                    capture_output=True).returncode != 0, reason="docker compose is not installed here")
def test_docker_compose_config_accepts_the_file():
    done = subprocess.run(["docker", "compose", "-f", str(COMPOSE), "--profile", "gpu", "config", "-q"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def _stages(text: str) -> tuple[dict[str, str], dict[str, str]]:
    """(global ARG defaults, stage name -> what it is FROM) of a Dockerfile."""
    args, stages = {}, {}
    in_stage = False
    for line in text.splitlines():
        if m := re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line, re.IGNORECASE):
            in_stage = True
            stages[m.group(2) or f"stage{len(stages)}"] = m.group(1)
        elif (m := re.match(r"ARG\s+(\w+)=(\S+)", line)) and not in_stage:
            args[m.group(1)] = m.group(2)
    return args, stages


def _root(stages: dict[str, str], target: str) -> tuple[str, list[str]]:
    """The external image a stage finally builds FROM, and the stages on the way."""
    chain = [target]
    while stages[chain[-1]] in stages:
        chain.append(stages[chain[-1]])
    return stages[chain[-1]], chain


def test_head_and_workers_share_one_image_lineage_so_python_and_ray_agree():
    compose = _compose()
    text = DOCKERFILE.read_text()
    args, stages = _stages(text)
    targets = {}
    for name in (*FOLDTUNE_SERVICES, *_gpu_workers(compose)):
        build = compose["services"][name]["build"]
        assert (ROOT / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE, name
        targets[name] = build["target"]
    roots = {name: _root(stages, target) for name, target in targets.items()}
    # Every service image descends from the one `base` stage, itself the only stage on an outside image.
    assert {root for root, _ in roots.values()} == {"python:${PYTHON_VERSION}-slim"}
    assert all(chain[-1] == "base" for _, chain in roots.values())
    assert [s for s, frm in stages.items() if frm not in stages] == ["base"]
    assert re.fullmatch(r"3\.\d+", args["PYTHON_VERSION"]) and re.fullmatch(r"\d+\.\d+\.\d+", args["RAY_VERSION"])
    # Ray comes in at one pinned version: every install names ${RAY_VERSION}, never another version.
    ray_pins = re.findall(r"ray(?:\[[\w,]+\])?==([^\s\"']+)", text)
    assert ray_pins and set(ray_pins) == {"${RAY_VERSION}"}
    assert "FROM nvcr.io" not in text and "python3." not in text  # no second Python from another base image
    assert targets["runner"] == targets["api"] == "service"
    assert set(targets[w] for w in _gpu_workers(compose)) == {"gpu-worker"}


def test_services_restart_and_have_healthchecks_on_healthz():
    services = _compose()["services"]
    for name, service in services.items():
        assert service.get("restart") in ("always", "unless-stopped", "on-failure"), name
        assert service.get("healthcheck", {}).get("test"), name
    for name, port in (("api", 8321), ("runner", 8322)):
        probe = " ".join(services[name]["healthcheck"]["test"])
        assert f"127.0.0.1:{port}/healthz" in probe, name
    assert "--health-port=8322" in " ".join(services["runner"]["command"])
    for name, worker in _gpu_workers(_compose()).items():
        assert "ray health-check --address runner:6379" in " ".join(worker["healthcheck"]["test"]), name
        assert worker["depends_on"]["runner"]["condition"] == "service_healthy"


def test_data_and_checkpoints_live_on_one_volume_mounted_alike_everywhere():
    compose = _compose()
    root = compose["x-foldtune-env"]["FOLDTUNE_DATA_ROOT"]
    for name in (*FOLDTUNE_SERVICES, *_gpu_workers(compose)):
        service = compose["services"][name]
        assert service["environment"]["FOLDTUNE_DATA_ROOT"] == root, name
        assert f"userdata:{root}" in service["volumes"], name
    assert "userdata" in compose["volumes"]


def test_ray_runs_with_token_auth_and_the_head_port_is_bound_to_a_setting():
    compose = _compose()
    services = compose["services"]
    for name in ("runner", *_gpu_workers(compose)):
        env = services[name]["environment"]
        assert env["RAY_AUTH_MODE"] == "token", name
        token_dir = str(Path(env["FOLDTUNE_RAY_AUTH_TOKEN_FILE"]).parent)
        mounts = [v for v in services[name]["volumes"] if v.split(":")[1] == token_dir]
        assert len(mounts) == 1 and mounts[0].startswith("ray-auth:"), name
        assert "RAY_AUTH_TOKEN_PATH=" in " ".join(services[name]["command"]), name
    assert "disabled" not in COMPOSE.read_text()
    assert services["runner"]["ports"] == ["${FOLDTUNE_RAY_BIND:-127.0.0.1}:6379:6379"]
    assert services["api"]["ports"] == ["${FOLDTUNE_API_BIND:-127.0.0.1}:8321:8321"]


def test_one_worker_per_gpu_set_with_disjoint_devices():
    workers = _gpu_workers(_compose())
    assert len(workers) >= 2
    seen: set[str] = set()
    for name, worker in workers.items():
        [device] = worker["deploy"]["resources"]["reservations"]["devices"]
        assert "count" not in device and device["device_ids"], name  # never `count: all`
        assert not seen & set(device["device_ids"]), name
        seen |= set(device["device_ids"])


def _scripts(compose: dict) -> dict[str, str]:
    """Each service's shell script (a ``bash -c`` / ``sh -c`` command), Compose's ``$$`` unescaped."""
    scripts = {}
    for name, service in compose["services"].items():
        command = service.get("command")
        if isinstance(command, list) and command[:2] in (["bash", "-c"], ["sh", "-c"]):
            scripts[name] = command[2].replace("$$", "$")
    return scripts


def test_every_service_script_fails_closed():
    scripts = _scripts(_compose())
    assert set(scripts) >= {"runner", *_gpu_workers(_compose())}
    for name, script in scripts.items():
        assert re.match(r"set -e\w*( -o pipefail)?;", script) or script.startswith("set -euo pipefail;"), name
        # `export/local/declare/readonly X=$(...)` returns the builtin's status, not the command's: masked
        assert not re.search(r"\b(export|local|declare|readonly)\s+\w+=[\"']?\$\(", script), name
        assert "&&" not in script, name  # under set -e a failed `a && b` list does not stop the script


def _run_script(script: str, tmp_path: Path, env: dict[str, str], python_prints: str | None) -> tuple[int, set[str]]:
    """Run ``script`` with stub ``python`` (printing ``python_prints``, or failing when None), ``ray``,
    ``foldtune`` and ``nproc``; returns its exit status and which of ray/foldtune it started."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    ran = tmp_path / "ran"
    stubs = {"python": f"echo {python_prints}" if python_prints is not None else "exit 1",
             "ray": f"echo ray >> {ran}", "foldtune": f"echo foldtune >> {ran}", "nproc": "echo 4"}
    for stub, body in stubs.items():
        (bin_dir / stub).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / stub).chmod(0o755)
    ran.unlink(missing_ok=True)
    done = subprocess.run(["bash", "-c", script], env={"PATH": f"{bin_dir}:/usr/bin:/bin", **env},
                          capture_output=True, text=True, timeout=60)
    return done.returncode, set(ran.read_text().split()) if ran.exists() else set()


def test_the_runner_starts_nothing_when_the_token_helper_fails(tmp_path):
    compose = _compose()
    script = _scripts(compose)["runner"]
    token = tmp_path / "token"
    token.write_text("secret")
    assert _run_script(script, tmp_path, {}, str(token)) == (0, {"ray", "foldtune"})  # the stubs run through
    code, ran = _run_script(script, tmp_path, {}, None)  # the helper fails
    assert code != 0 and ran == set()
    code, ran = _run_script(script, tmp_path, {}, "")  # the helper prints no path
    assert code != 0 and ran == set()


def test_a_gpu_worker_starts_nothing_without_the_token_file(tmp_path):
    compose = _compose()
    for name in _gpu_workers(compose):
        script = _scripts(compose)[name]
        token = tmp_path / "token"
        token.write_text("secret")
        assert _run_script(script, tmp_path, {"FOLDTUNE_RAY_AUTH_TOKEN_FILE": str(token)}, None) == (0, {"ray"})
        for env in ({}, {"FOLDTUNE_RAY_AUTH_TOKEN_FILE": str(tmp_path / "missing")}):
            code, ran = _run_script(script, tmp_path, env, None)
            assert code != 0 and ran == set(), (name, env)

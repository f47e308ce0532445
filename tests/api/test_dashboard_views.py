"""The API views the dashboard reads: the Megatron-LM arguments of a job's best measured layout, and a
training's checkpoints; both only for their owner. Also GET / and the offline /docs pages, and the dashboard's
plotting library (plotly.js, served from the installed plotly package)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from db.engine import make_engine, make_sessionmaker
from db.queue import claim_job
from db.trials import finish_trial, start_trial
from spec.parallel_config import ParallelConfig

LAYOUT = "tp1 cp1 pp1 vpp1 ep2 etp1 dp4 edp2 mbs1"


def _measure(db_url, job_id, number, label, step_time_s):
    engine = make_engine(db_url)
    try:
        with make_sessionmaker(engine)() as session:
            config = ParallelConfig.parse(label, world_size=4)
            trial = start_trial(session, job_id, number, config.to_dict(), runner_id="r", label=config.label())
            assert finish_trial(session, trial.id, "succeeded", step_time_s=step_time_s,
                                measurement={"ok": True, "step_time": step_time_s})
    finally:
        engine.dispose()


def test_megatron_args_of_the_best_measured_trial_owner_only(client, alice, bob, db_url, job_body):
    job_id = client.post("/v1/jobs", json=job_body, headers=alice).json()["id"]
    r = client.get(f"/v1/jobs/{job_id}/megatron-args", headers=alice)
    assert r.status_code == 404 and r.json()["type"] == "urn:foldtune:problem:no-measured-layout"
    engine = make_engine(db_url)
    with make_sessionmaker(engine)() as session:
        assert claim_job(session, job_id, "r") is not None
    engine.dispose()
    _measure(db_url, job_id, 0, "tp1 ep2 dp4 mbs1", 0.50)
    _measure(db_url, job_id, 1, "tp2 ep2 dp2 mbs1", 0.25)  # the faster one is the best
    r = client.get(f"/v1/jobs/{job_id}/megatron-args", headers=alice)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["trial_number"] == 1 and body["step_time_s"] == 0.25 and body["layout"].startswith("tp2 ")
    assert ["--tensor-model-parallel-size", "2"] in body["args"]
    assert ["--global-batch-size", str(job_body["training"]["global_batch_size"])] in body["args"]
    assert body["environment"] == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}  # TP 2: Megatron asserts it
    lines = body["text"].splitlines()
    assert lines[:2] == ["export CUDA_DEVICE_MAX_CONNECTIONS=1", "MEGATRON_ARGS=("] and lines[-1] == ")"
    assert "    --tensor-model-parallel-size 2" in lines
    other = client.get(f"/v1/jobs/{job_id}/megatron-args", headers=bob)
    assert other.status_code == 404 and other.json()["type"] == "urn:foldtune:problem:not-found"
    assert client.get(f"/v1/jobs/{job_id}/megatron-args").status_code == 401


def test_training_checkpoints_listed_in_step_order_owner_only(client, alice, bob, training_body):
    ckpt = Path(training_body["checkpoint_dir"])  # in alice's directory under the data root
    for step, complete in ((20, True), (10, True), (30, False)):
        d = ckpt / f"step-{step:08d}"
        d.mkdir(parents=True)
        (d / "shard.distcp").write_bytes(b"x" * step)
        if complete:
            (d / "trainer.pt").write_bytes(b"t")
    (ckpt / "latest").write_text("step-00000020\n")
    (ckpt / "notes").mkdir()  # not a checkpoint
    r = client.post("/v1/trainings", json=training_body, headers=alice)
    assert r.status_code == 201, r.text
    tid = r.json()["id"]
    body = client.get(f"/v1/trainings/{tid}/checkpoints", headers=alice).json()
    assert body["checkpoint_dir"] == str(ckpt)
    assert [(c["step"], c["complete"], c["latest"], c["bytes"]) for c in body["items"]] == [
        (10, True, False, 11), (20, True, True, 21), (30, False, False, 30)]
    assert client.get(f"/v1/trainings/{tid}/checkpoints", headers=bob).status_code == 404


def test_dashboard_and_docs_are_served_from_the_package(client):
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'src="/static/dashboard/app.js"' in page.text
    docs = client.get("/docs")
    assert docs.status_code == 200
    assets = re.findall(r'(?:href|src)="([^"]+)"', docs.text)
    assert assets and all(a.startswith("/static/swagger-ui/") for a in assets), assets
    for asset in assets + ["/static/dashboard/plot.js", "/static/dashboard/style.css"]:
        assert client.get(asset).status_code == 200, asset
    assert "http://" not in docs.text and "https://" not in docs.text  # nothing from a CDN
    redoc = client.get("/redoc")
    assert redoc.status_code == 200
    assets = re.findall(r'(?:href|src)="([^"]+)"', redoc.text)
    assert "/static/redoc/redoc.standalone.js" in assets and all(a.startswith("/static/") for a in assets), assets
    assert all(client.get(a).status_code == 200 for a in assets)
    assert "http://" not in redoc.text and "https://" not in redoc.text  # no web fonts, no CDN
    paths = client.get("/openapi.json").json()["paths"]
    assert "/" not in paths and "/docs" not in paths and "/redoc" not in paths


def test_plotly_js_is_served_from_the_installed_plotly_package(client):
    import plotly

    installed = (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_bytes()
    page = client.get("/").text
    assert page.index('src="/vendor/plotly.min.js"') < page.index('src="/static/dashboard/plot.js"')
    plain = client.get("/vendor/plotly.min.js", headers={"Accept-Encoding": "identity"})
    assert plain.status_code == 200 and plain.headers["content-type"].startswith("text/javascript")
    assert plain.content == installed and b"plotly.js v" in installed[:200]
    packed = client.get("/vendor/plotly.min.js", headers={"Accept-Encoding": "gzip"})
    assert packed.headers["content-encoding"] == "gzip" and int(packed.headers["content-length"]) < len(installed) / 2
    assert packed.content == installed  # the client undoes the gzip it asked for
    again = client.get("/vendor/plotly.min.js", headers={"If-None-Match": plain.headers["etag"]})
    assert again.status_code == 304 and again.content == b""
    assert not (DASHBOARD / "plotly.min.js").exists()  # nothing of plotly's is copied into this repository
    assert "/vendor/plotly.min.js" not in client.get("/openapi.json").json()["paths"]


def test_without_plotly_the_server_refuses_to_start_and_says_why(db_url, data_root, monkeypatch, tmp_path):
    from api.http.app import create_app
    from api.http.routes import dashboard
    from api.http.settings import ApiSettings

    monkeypatch.setattr(dashboard.resources, "files", lambda name: tmp_path / name)  # a plotly without its data
    with pytest.raises(dashboard.DashboardAssetMissing, match="plotly.min.js: reinstall it"):
        create_app(ApiSettings(database_url=db_url, data_root=data_root))

    def not_installed(name):
        raise ModuleNotFoundError(name)

    monkeypatch.setattr(dashboard.resources, "files", not_installed)
    with pytest.raises(dashboard.DashboardAssetMissing, match="not installed: pip install plotly"):
        create_app(ApiSettings(database_url=db_url, data_root=data_root))


DASHBOARD = Path(__file__).resolve().parents[2] / "api" / "http" / "static" / "dashboard"


def _dashboard_api_paths() -> set[str]:
    """Every /v1 path the dashboard's scripts call, with each ${...} as '{}' and the query string dropped."""
    paths = set()
    for script in DASHBOARD.glob("*.js"):
        for path in re.findall(r"[\"`](/v1/[^\"`?]*)", script.read_text()):
            paths.add(re.sub(r"\$\{[^}]*\}", "{}", path))
    return paths


def test_every_route_the_dashboard_calls_exists_and_is_its_owners_only(client, alice, bob, training_body):
    used = _dashboard_api_paths()
    assert {"/v1/jobs", "/v1/jobs/{}/trials", "/v1/trainings/{}/metrics", "/v1/plans"} <= used  # the scan works
    spec = {re.sub(r"\{[^}]*\}", "{}", p): ops for p, ops in client.get("/openapi.json").json()["paths"].items()}
    assert used <= set(spec), sorted(used - set(spec))
    job_id = client.post("/v1/jobs", json={"model": "tiny-moe", "training": {"seq_length": 64, "global_batch_size": 8},
                                           "cluster": {"gpu": "cpu", "num_gpus": 4}}, headers=alice).json()["id"]
    r = client.post("/v1/trainings", json=training_body, headers=alice)
    assert r.status_code == 201, r.text
    ids = {"jobs": job_id, "trainings": r.json()["id"]}
    for path in sorted(used):
        method = "post" if path == "/v1/plans" else "get"
        assert method in spec[path], path
        if method == "post":
            assert client.post(path, json={}).status_code == 401
            continue
        assert client.get(path.replace("{}", "1")).status_code == 401, path  # no key
        if "{}" not in path:
            assert client.get(path, headers=alice).status_code == 200, path
            continue
        concrete = path.replace("{}", str(ids[path.split("/")[2]]))
        mine, other = client.get(concrete, headers=alice), client.get(concrete, headers=bob)
        # the owner gets the resource (or, for megatron-args and expert-load, "nothing measured yet"); anyone
        # else a plain 404
        assert mine.status_code == 200 or mine.json()["type"] in (
            "urn:foldtune:problem:no-measured-layout", "urn:foldtune:problem:no-expert-load"), path
        assert other.status_code == 404 and other.json()["type"] == "urn:foldtune:problem:not-found", path

"""The dashboard in a real browser: headless Chromium (Debian's ``chromium`` + ``chromium-driver``) driven by
Selenium against a live ``foldtune serve`` whose database holds a real finished tuning job and training
(tests/api/dashboard_env.py runs them). The tests check what a person sees: table rows, one plotly marker per
data point (each series is a plotly trace whose uid names it: ``g.trace.trace<uid> path.point``), tooltips,
durations, the per-layer expert-load heatmap, two trials and two trainings side by side, another owner's job
absent, every page without sideways scrolling and with Sign out on screen at 390 px and 1440 px, and the
dashboard (plotly.js included), /docs and /redoc with every request going to the server itself (the browser
resolves no other host)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
try:
    import selenium  # noqa: F401
    SELENIUM = True
except ImportError:
    SELENIUM = False

# CI (.ci/run) installs the browser and sets FOLDTUNE_REQUIRE_BROWSER=1: there a missing browser fails the
# tests instead of skipping them, so the dashboard is never "green" untested.
_MISSING = [what for what, ok in (("Chromium and its driver: apt-get install -y chromium chromium-driver",
                                   CHROMIUM and CHROMEDRIVER),
                                  ("selenium (pip install -e '.[dev]')", SELENIUM)) if not ok]
if _MISSING and os.environ.get("FOLDTUNE_REQUIRE_BROWSER") == "1":
    raise RuntimeError(f"FOLDTUNE_REQUIRE_BROWSER=1 but the browser tests need {'; '.join(_MISSING)}")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(_MISSING), reason=f"needs {'; '.join(_MISSING)}"),
]

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 30
SETTLE_S = 5  # seconds a page may take to lay out before its width is judged


@pytest.fixture(scope="module")
def dash(tmp_path_factory):
    """(base URL, DashboardData) of a `foldtune serve` subprocess on a database with real results."""
    from dashboard_env import build_dashboard_data

    # two trials: as many as the trial comparisons need
    data = build_dashboard_data(tmp_path_factory.mktemp("dashboard"), max_trials=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    log = open(tmp_path_factory.mktemp("serve") / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "api.cli.main", "serve", "--port", str(port),
                             "--database-url", data.database_url, "--log-level", "warning"],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(base + "/healthz", timeout=2):
                    break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "foldtune serve did not start"
                time.sleep(0.2)
        yield base, data
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1800",
                "--disable-gpu", "--no-first-run", "--disable-background-networking",
                # Every host but the test server resolves to nothing: a page that needs a CDN breaks.
                "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver, predicate, what):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(lambda d: predicate(d), message=what)


def _css(driver, selector):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def _open(driver, base, hash_):
    """Show page ``hash_`` (e.g. '#/jobs/1') and wait until it has rendered."""
    driver.get(f"{base}/{hash_}")
    _wait(driver, lambda d: d.execute_script("return document.getElementById('main').dataset.loaded") == hash_,
          f"page {hash_} rendered")


def sign_in(driver, base, key, accepted=True):
    driver.get(base + "/")
    driver.execute_script("sessionStorage.clear()")
    driver.get(base + "/")
    _wait(driver, lambda d: _css(d, "#api-key"), "the sign-in form")
    _css(driver, "#api-key")[0].send_keys(key)
    _css(driver, "#signin button")[0].click()
    if accepted:
        _wait(driver, lambda d: d.execute_script("return document.getElementById('main').dataset.loaded") == "#/jobs",
              "the jobs page after signing in")


def _api(base, key, path):
    req = urllib.request.Request(base + path, headers={"X-API-Key": key})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _rows(driver, table_id):
    """The table's cells as text, read in one script (a live page may re-render between two reads)."""
    return driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map(tr => [...tr.cells].map(td => td.innerText.trim()))",
        f"#{table_id} tbody tr")


def _circles(driver, plot_id, cls=""):
    """The markers plotly drew for series ``cls`` of a plot (a trace's uid words: "train-loss.run-3"), or for all."""
    return _css(driver, f"#{plot_id} g.trace{'.trace' + cls if cls else ''} path.point")


def _lines(driver, plot_id, cls):
    """The line paths plotly drew for series ``cls`` of a plot."""
    return _css(driver, f"#{plot_id} g.trace.trace{cls} path.js-line")


def _tips(driver, plot_id, uid):
    """The hover texts of the plot's trace ``uid``, one per point, lines joined by newlines."""
    return driver.execute_script(
        "const t = document.getElementById(arguments[0]).data.find(t => t.uid === arguments[1]);"
        "return t ? t.text.map(x => x.replaceAll('<br>', '\\n')) : null", plot_id, uid)


def _tick_labels(driver, plot_id, axis):
    """The tick labels of a plot's x or y axis, as shown (plotly's minus sign read as '-')."""
    return driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map(t => t.textContent.replaceAll('\u2212', '-'))",
        f"#{plot_id} g.{axis}tick text")


def _hover_text(driver, point) -> str:
    """The tooltip plotly shows with the mouse on ``point`` (a marker element)."""
    from selenium.webdriver.common.action_chains import ActionChains

    ActionChains(driver).move_to_element(point).perform()
    _wait(driver, lambda d: _css(d, "g.hoverlayer g.hovertext"), "a tooltip")
    return driver.execute_script(
        "return [...document.querySelectorAll('g.hoverlayer g.hovertext text')].map(t => t.textContent).join('\\n')")


def _seconds_of(text):
    """Seconds from the dashboard's wall-time text: '42 s', '3 min 05 s', '2 h 07 min'."""
    units = {"d": 86400, "h": 3600, "min": 60, "s": 1}
    parts = re.findall(r"(\d+) (d|h|min|s)\b", text)
    assert parts, text
    return sum(int(n) * units[u] for n, u in parts)


def _ran_s(x):
    """Seconds between a job's, trial's or training's started_at and finished_at (API JSON)."""
    from datetime import datetime

    return (datetime.fromisoformat(x["finished_at"]) - datetime.fromisoformat(x["started_at"])).total_seconds()


def _value(label):
    """The number a tick label shows: '2.5k' -> 2500, '2e-4' -> 0.0002."""
    scale = {"k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
    return float(label[:-1]) * scale[label[-1]] if label[-1] in scale else float(label)


def _shows(text, value, rel=2e-3):
    """Whether ``text`` shows ``value`` (to four significant digits, in any of its numbers)."""
    return any(float(n) == pytest.approx(value, rel=rel)
               for n in re.findall(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", text))


def test_sign_in_shows_only_the_owners_jobs_and_updates_them_live(dash, browser):
    base, data = dash
    sign_in(browser, base, "ft_not-a-key", accepted=False)
    driver = browser
    _wait(driver, lambda d: _css(d, "#signin-error"), "the rejected key's message")
    assert "not accepted" in _css(driver, "#signin-error")[0].text
    assert driver.execute_script("return sessionStorage.getItem('foldtune.apiKey')") is None

    sign_in(driver, base, data.keys["alice"])
    job = _api(base, data.keys["alice"], f"/v1/jobs/{data.job_id}")
    rows = _rows(driver, "jobs-table")
    assert len(rows) == 1  # alice's one job; bob's is not listed
    ident, status, model, cluster, trials, best, took, _ = rows[0]
    assert (ident, status, model, cluster) == (f"#{data.job_id}", "succeeded", "tiny-moe", "2 × cpu")
    assert _seconds_of(took) == pytest.approx(_ran_s(job), abs=1)
    assert trials == f"{job['trials']['total']}/{job['budget']['max_trials']}" == "2/2"
    assert best.endswith(" ms") and float(best[:-3]) == pytest.approx(job["best_trial"]["step_time_s"] * 1e3, rel=1e-3)
    _open(driver, base, f"#/jobs/{data.bob_job_id}")
    assert "Not found" in _css(driver, "#page-error")[0].text  # bob's job reads like a missing one

    # Bob sees his queued job; the page polls while it is live, so a cancel shows up without a reload.
    _css(driver, "#sign-out")[0].click()
    sign_in(driver, base, data.keys["bob"])
    assert [r[:2] for r in _rows(driver, "jobs-table")] == [[f"#{data.bob_job_id}", "queued"]]
    req = urllib.request.Request(f"{base}/v1/jobs/{data.bob_job_id}/cancel", method="POST",
                                 headers={"X-API-Key": data.keys["bob"]})
    urllib.request.urlopen(req, timeout=30).close()
    _wait(driver, lambda d: [r[1] for r in _rows(d, "jobs-table")] == ["cancelled"], "the cancel, by polling")


def test_job_page_tables_and_plots(dash, browser):
    base, data = dash
    key = data.keys["alice"]
    sign_in(browser, base, key)
    _open(browser, base, f"#/jobs/{data.job_id}")
    job = _api(base, key, f"/v1/jobs/{data.job_id}")
    trials = _api(base, key, f"/v1/jobs/{data.job_id}/trials")["items"]
    measured = [t for t in trials if t["step_time_s"] is not None and t["predicted_step_time_s"] is not None]
    assert len(measured) >= 2, [t["failure_reason"] for t in trials]

    rows = _rows(browser, "trials-table")  # compare box, #, state, layout, predicted, calibrated, measured, took, ...
    assert [r[1] for r in rows] == [str(t["number"]) for t in trials]
    assert [r[2] for r in rows] == [t["status"] for t in trials]
    assert [r[3] for r in rows] == [t["label"] for t in trials]
    assert all(r[4].endswith(" ms") and r[5].endswith(" ms") for r in rows)  # predicted, calibrated
    assert [_seconds_of(r[7]) for r in rows] == pytest.approx([_ran_s(t) for t in trials], abs=1)
    assert _seconds_of(_css(browser, "#job-took")[0].text) == pytest.approx(_ran_s(job), abs=1)

    calibrated = {r["number"] for r in job["calibration"]["measured_vs_predicted"] if r["calibrated_step_time"]}
    assert len(_circles(browser, "plot-pred-vs-measured", "raw")) == len(measured)
    assert len(_circles(browser, "plot-pred-vs-measured", "calibrated")) == len(
        [t for t in measured if t["number"] in calibrated])
    assert len(_lines(browser, "plot-pred-vs-measured", "identity")) == 1  # y = x
    first = measured[0]
    tip = _hover_text(browser, _circles(browser, "plot-pred-vs-measured", "raw")[0])
    assert f"trial {first['number']} {first['label']}" in tip and _shows(tip, first["step_time_s"] * 1e3), tip
    assert len(_circles(browser, "plot-best-so-far", "best")) == len(measured)
    assert len(_lines(browser, "plot-best-so-far", "best")) == 1
    # the trial axis spans the trials run (no trial -1) in whole numbers
    numbers = [int(x) for x in _tick_labels(browser, "plot-best-so-far", "x")]
    assert numbers and min(numbers) >= 0 and max(numbers) <= max(t["number"] for t in trials)
    sizes = browser.execute_script("return [...document.querySelectorAll('#plot-best-so-far path.point')]"
                                   ".map(p => p.getBoundingClientRect().width)")
    assert sizes and min(sizes) >= 6  # visible markers: 6 px across at least

    ranked = sorted(measured, key=lambda t: t["step_time_s"])[:2]
    assert _stacked_bars(browser, "plot-terms") == [
        (f"{'runner-up' if i else 'best'} (#{t['number']})", {k for k, v in t["predicted"]["terms_s"].items() if v > 0})
        for i, t in enumerate(ranked)]

    factors = job["calibration"]["time_multipliers"]
    assert len(_rows(browser, "calibration-table")) == len(factors) + 3
    args = _api(base, key, f"/v1/jobs/{data.job_id}/megatron-args")
    assert args["layout"] == job["best_trial"]["label"]
    assert _css(browser, "#megatron-args")[0].text == args["text"]
    _css(browser, "#copy-args")[0].click()
    _wait(browser, lambda d: "copied" in d.find_element("css selector", "#copy-args + .hint").text or
          "selected" in d.find_element("css selector", "#copy-args + .hint").text, "the copy button's answer")


def _stacked_bars(driver, plot_id):
    """[(bar label as shown on the axis, {terms drawn in it})] of a stacked bar chart, read from plotly's DOM:
    each term a trace of its own ("term <name>"), one drawn segment per bar it is part of."""
    labels = _tick_labels(driver, plot_id, "x")
    drawn = driver.execute_script("""
        const gd = document.getElementById(arguments[0]);
        const traces = [...gd.querySelectorAll('g.trace.bars')];
        return gd.data.map((t, i) => ({term: t.name, x: t.x, y: t.y, segments: [...traces[i].querySelectorAll(
            'g.point path')].filter(p => p.getBoundingClientRect().height > 0).length}));""", plot_id)
    bars = [(label, set()) for label in labels]
    for trace in drawn:
        shown = [x for x, y in zip(trace["x"], trace["y"]) if y is not None]
        assert trace["segments"] == len(shown), trace  # a segment drawn for every bar the term is in
        for label, terms in bars:
            if label in shown:
                terms.add(trace["term"])
    return bars


def test_training_page_plots_every_step_and_lists_checkpoints(dash, browser):
    from dashboard_env import TRAIN_STEPS

    base, data = dash
    key = data.keys["alice"]
    sign_in(browser, base, key)
    _open(browser, base, "#/trainings")
    listed = sorted([data.training_id, data.other_training_id], reverse=True)  # newest first
    assert [r[1:3] for r in _rows(browser, "trainings-table")] == [[f"#{i}", "succeeded"] for i in listed]
    _open(browser, base, f"#/trainings/{data.training_id}")
    training = _api(base, key, f"/v1/trainings/{data.training_id}")
    metrics = _api(base, key, f"/v1/trainings/{data.training_id}/metrics?limit=200")["items"]
    assert len(metrics) == TRAIN_STEPS
    assert _seconds_of(_css(browser, "#training-took")[0].text) == pytest.approx(_ran_s(training), abs=1)
    assert len(_circles(browser, "plot-loss", "train-loss")) == TRAIN_STEPS
    evals = [m for m in metrics if m["eval_loss"] is not None]
    assert evals and len(_circles(browser, "plot-loss", "eval-loss")) == len(evals)
    assert len(_circles(browser, "plot-tokens", "tokens")) == TRAIN_STEPS
    assert len(_circles(browser, "plot-step-time", "measured")) == TRAIN_STEPS
    assert len(_lines(browser, "plot-step-time", "predicted")) == 1
    # learning rate, gradient norm and expert load, one point per stored step, each tip saying the stored value
    for plot, cls, values in (("plot-lr", "lr", [m["lr"] for m in metrics]),
                              ("plot-grad-norm", "grad-norm", [m["grad_norm"] for m in metrics]),
                              ("plot-expert-load", "expert-load", [m["expert_load_max"] for m in metrics])):
        tips = _tips(browser, plot, cls)
        assert len(_circles(browser, plot, cls)) == len(tips) == TRAIN_STEPS and None not in values, plot
        for tip, m, v in zip(tips, metrics, values):
            assert tip.startswith(f"step {m['step']}: ") and _shows(tip, v), (plot, tip, v)
    shown = _hover_text(browser, _circles(browser, "plot-lr", "lr")[-1])  # the tooltip a person sees
    assert shown.startswith(f"step {TRAIN_STEPS}: lr") and _shows(shown, metrics[-1]["lr"]), shown
    assert max(m["lr"] for m in metrics) <= training["recipe"]["lr"] * (1 + 1e-9)
    checkpoints = _api(base, key, f"/v1/trainings/{data.training_id}/checkpoints")["items"]
    assert [c["step"] for c in checkpoints] == [TRAIN_STEPS // 2, TRAIN_STEPS]
    assert [r[0] for r in _rows(browser, "checkpoints-table")] == [str(c["step"]) for c in checkpoints]
    assert _rows(browser, "checkpoints-table")[-1][3] == "complete, latest"


def test_training_page_shows_each_moe_layers_expert_load(dash, browser):
    """The latest step's routed tokens per layer and expert as a heatmap (each layer's tokens summing to the step's
    tokens × top-k), and each layer's busiest / mean expert over the steps."""
    from dashboard_env import DASH_JOB, TRAIN_STEPS

    base, data = dash
    key = data.keys["alice"]
    sign_in(browser, base, key)
    _open(browser, base, f"#/trainings/{data.training_id}")
    load = _api(base, key, f"/v1/trainings/{data.training_id}/expert-load")
    training = DASH_JOB["training"]
    per_layer = training["seq_length"] * training["global_batch_size"] * 2  # tiny-moe routes each token to 2
    assert load["step"] == TRAIN_STEPS and load["layers"] == [0, 1] and load["tokens_per_layer"] == per_layer
    assert [sum(row) for row in load["tokens"]] == [per_layer] * 2
    _wait(browser, lambda d: _css(d, "#plot-expert-heatmap g.hm image"), "the heatmap's cells")
    shown = browser.execute_script("const t = document.getElementById('plot-expert-heatmap').data[0];"
                                   "return {z: t.z, rows: t.y, text: t.text}")
    share = per_layer / load["num_experts"]
    assert shown["rows"] == ["layer 0", "layer 1"]
    assert shown["z"] == [[pytest.approx(c / share) for c in row] for row in load["tokens"]]
    assert [[int(re.search(r"(\d+) tokens", tip)[1]) for tip in row] for row in shown["text"]] == load["tokens"]
    assert f"at step {TRAIN_STEPS}" in _css(browser, "#plot-expert-heatmap")[0].find_element(
        "xpath", "ancestor::section").text
    imbalance = _api(base, key, f"/v1/trainings/{data.training_id}/expert-load/imbalance?limit=200")["items"]
    assert [i["step"] for i in imbalance] == list(range(1, TRAIN_STEPS + 1))
    for row, layer in enumerate(load["layers"]):
        tips = _tips(browser, "plot-expert-imbalance", f"imbalance layer-{layer}")
        assert len(_circles(browser, "plot-expert-imbalance", f"imbalance.layer-{layer}")) == len(tips) == TRAIN_STEPS
        for tip, item in zip(tips, imbalance):
            assert tip.startswith(f"step {item['step']}: layer {layer} ") and _shows(tip, item["max_over_mean"][row])
    assert load["max_over_mean"] == [pytest.approx(max(r) * len(r) / sum(r)) for r in load["tokens"]]


def test_the_dashboard_loads_nothing_but_the_server(dash, browser):
    """The pages with plots load plotly.js from this server (the installed plotly package) and nothing else."""
    base, data = dash
    sign_in(browser, base, data.keys["alice"])
    browser.get_log("performance")  # drop what earlier pages requested
    for hash_ in (f"#/jobs/{data.job_id}", f"#/trainings/{data.training_id}"):
        browser.get(f"{base}/{hash_}")
        browser.refresh()  # a whole page load (a new hash alone keeps the page and its scripts)
        _wait(browser, lambda d: d.execute_script("return document.getElementById('main').dataset.loaded") == hash_,
              f"page {hash_} rendered")
        _wait(browser, lambda d: _css(d, ".plot-host svg.main-svg"), "plotly's plots")
    requested = _assert_only_the_server_was_asked(browser)
    assert f"{base}/vendor/plotly.min.js" in requested


def test_plan_explorer_plots_the_plan_with_its_pareto_front(dash, browser):
    base, data = dash
    key = data.keys["alice"]
    sign_in(browser, base, key)
    plan = _plan(browser, base, key, "tiny-moe", "h100-sxm", 16, 512, 32, 40)
    _wait(browser, lambda d: _css(d, "#plot-plan svg.main-svg"), "the plan's plot")
    points = [(e["memory_bytes"]["total"], e["step_time_s"]) for e in plan["ranked"]]
    front, best = [], float("inf")
    for mem, step in sorted(points):
        if step < best:
            front.append((mem, step))
            best = step
    assert len(_circles(browser, "plot-plan")) == len(plan["ranked"]) == 40
    assert len(_circles(browser, "plot-plan", "pareto")) == len(front)
    assert len(_lines(browser, "plot-plan", "front")) == 1
    usable_gib = plan["cluster"]["usable_hbm_bytes"] / 2**30
    assert _capacity_lines(browser) == [pytest.approx(usable_gib)]  # the usable-memory line
    legend = _css(browser, "#plot-plan")[0].get_attribute("textContent")
    shown = re.search(r"usable ([0-9.]+) GiB", legend)  # named in the legend, to three digits
    assert shown and float(shown[1]) == pytest.approx(usable_gib, rel=5e-3), legend
    assert len(_rows(browser, "rejected-table")) == len(plan["rejected"]) > 0
    assert f"{plan['considered']} layouts considered" in _css(browser, "#plan-counts")[0].text
    from selenium.webdriver.common.action_chains import ActionChains

    ActionChains(browser).move_to_element(_circles(browser, "plot-plan", "pareto")[0]).perform()
    _wait(browser, lambda d: "MFU" in _css(d, "#plan-detail")[0].text, "details on hover")
    assert _css(browser, "#plan-detail")[0].text.split("\n")[0] in {e["layout"] for e in plan["ranked"]}
    # every estimate's step-time and memory interval: a whisker each way a point, and a row of the ranked table each
    assert all(e["step_time_interval_s"]["low"] <= e["step_time_s"] <= e["step_time_interval_s"]["high"]
               for e in plan["ranked"])
    assert len(_css(browser, "#plot-plan path.yerror")) == len(_css(browser, "#plot-plan path.xerror")) == len(
        plan["ranked"])
    rows = _rows(browser, "ranked-table")
    assert [r[1] for r in rows] == [e["layout"] for e in plan["ranked"]]
    assert all("–" in r[3] and "–" in r[5] for r in rows)  # step and memory intervals
    assert "high end of the step-time interval" in _css(browser, "#plan-counts")[0].text
    assert "(" in _css(browser, "#plan-detail")[0].text.split("\n")[1]  # step with its interval on hover
    # ranked with the layouts foldtune's executor runs first: here all 40 of them
    assert plan["ranking"] == "executable_first" and all(e["executable"] for e in plan["ranked"])
    assert "those foldtune's executor runs first" in _css(browser, "#plan-counts")[0].text
    assert _css(browser, "#plan-detail")[0].text.endswith("runs on foldtune's executor")
    assert not _circles(browser, "plot-plan", "megatron")
    # ranked as Megatron-Core runs them, by the point estimate: layouts on Megatron's flex dispatcher (DeepEP /
    # HybridEP kernels), and any tp4 layouts (the executor does not build 2 KV heads over 4 TP ranks) or CUDA-graph
    # layouts the executor cannot capture that make the 40, join them and are drawn apart, unless on the front
    plan = _plan(browser, base, key, "tiny-moe", "h100-sxm", 16, 512, 32, 40, megatron=True, rank_by="point")
    _wait(browser, lambda d: _css(d, "#plot-plan svg"), "the plan's plot")
    assert plan["ranking"] == "megatron"
    only = [e for e in plan["ranked"] if not e["executable"]]
    heads = [e for e in only if e["executable_reason"].startswith("[executor_heads_tp]")]
    flex = [e for e in only if e["config"]["moe_token_dispatcher_type"].startswith("flex_")]
    # and Megatron's graphs where the executor's capture does not hold (rule executor_cuda_graphs)
    graphs = [e for e in only if e["executable_reason"].startswith("[executor_cuda_graphs]")]
    assert flex and len(heads) + len(flex) + len(graphs) == len(only), [e["executable_reason"] for e in only]
    assert all(e["executable_reason"].startswith("[executor_dispatcher]") for e in flex)
    assert f", as Megatron-Core runs them; {len(only)} only Megatron-Core runs" in _css(browser, "#plan-counts")[0].text
    # each hover text's first line names its layout: the front's Megatron-only layouts plus the purple ones
    front_layouts = {t.split("\n")[0] for t in _tips(browser, "plot-plan", "pareto")}
    only_on_front = [e for e in only if e["layout"] in front_layouts]
    assert len(_circles(browser, "plot-plan", "megatron")) + len(only_on_front) == len(only)


def _capacity_lines(browser) -> list[float]:
    """The x (GiB) of each dashed usable-memory line on the plan's plot: a plotly shape, drawn and named."""
    shapes = browser.execute_script("return document.getElementById('plot-plan').layout.shapes"
                                    ".filter(s => s.name.startsWith('usable')).map(s => s.x0)")
    assert len(_css(browser, "#plot-plan g.shapelayer path")) == len(shapes)
    return shapes


def _plan(browser, base, key, model, gpu, gpus, seq, gbs, top, megatron=False, rank_by="robust"):
    """Fill the plan explorer's form, submit it and wait for its answer; returns the same plan from the API."""
    from selenium.webdriver.support.ui import Select

    _open(browser, base, "#/plan")
    _wait(browser, lambda d: d.execute_script("return document.getElementById('plan-form').dataset.ready"),
          "the model and GPU lists")
    Select(_css(browser, "#plan-model")[0]).select_by_value(model)
    Select(_css(browser, "#plan-gpu")[0]).select_by_value(gpu)
    for field, value in (("#plan-gpus", gpus), ("#plan-seq", seq), ("#plan-gbs", gbs), ("#plan-top", top)):
        _css(browser, field)[0].clear()
        _css(browser, field)[0].send_keys(str(value))
    Select(_css(browser, "#plan-rank-by")[0]).select_by_value(rank_by)
    if _css(browser, "#plan-megatron")[0].is_selected() != megatron:
        _css(browser, "#plan-megatron")[0].click()
    _css(browser, "#plan-form button")[0].click()
    _wait(browser, lambda d: _css(d, "#plan-counts"), "the plan's answer")
    body = json.dumps({"model": model, "cluster": {"gpu": gpu, "num_gpus": gpus},
                       "training": {"seq_length": seq, "global_batch_size": gbs, "precision": "bf16"}, "top": top,
                       "megatron": megatron, "rank_by": rank_by})
    req = urllib.request.Request(base + "/v1/plans", data=body.encode(), method="POST",
                                 headers={"X-API-Key": key, "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_plan_that_fits_nothing_says_so_and_draws_no_front(dash, browser):
    base, data = dash
    key = data.keys["alice"]
    sign_in(browser, base, key)
    plan = _plan(browser, base, key, "mixtral-8x7b", "h100-sxm", 2, 4096, 8, 10)  # 47 B parameters on 2 GPUs
    assert plan["fitting"] == 0 and plan["ranked"] == [] and plan["closest"] is not None
    verdict = _css(browser, "#plan-counts")[0]
    assert "None fits" in verdict.text and "warn" in verdict.get_attribute("class")
    usable_gib, needed_gib = plan["cluster"]["usable_hbm_bytes"] / 2**30, plan["closest"]["memory_bytes"]["total"] / 2**30
    assert _shows(verdict.text, usable_gib) and _shows(verdict.text, needed_gib)
    svg_text = _css(browser, "#plot-plan")[0].get_attribute("textContent")
    assert "Pareto" not in svg_text and not _lines(browser, "plot-plan", "front")
    assert len(_circles(browser, "plot-plan")) == len(_circles(browser, "plot-plan", "closest")) == 1
    assert _capacity_lines(browser) == [pytest.approx(usable_gib)]
    # the capacity line lies left of the closest layout on screen: it needs more than there is
    line = _css(browser, "#plot-plan g.shapelayer path")[0].rect
    point = _circles(browser, "plot-plan", "closest")[0].rect
    assert line["x"] + line["width"] / 2 < point["x"] + point["width"] / 2


def test_two_trials_side_by_side(dash, browser):
    base, data = dash
    key = data.keys["alice"]
    sign_in(browser, base, key)
    _open(browser, base, f"#/jobs/{data.job_id}")
    trials = _api(base, key, f"/v1/jobs/{data.job_id}/trials")["items"]
    both = [t for t in trials if (t["predicted"] or {}).get("terms_s") and (t["measurement"] or {}).get("phases")]
    assert len(both) >= 2, [t["failure_reason"] for t in trials]
    a, b = both[0], both[-1]
    for t in (a, b):
        _css(browser, f"input.pick-trial[data-number='{t['number']}']")[0].click()
    link = _css(browser, "#compare-trials")[0]
    assert link.text == f"Compare trials {a['number']} and {b['number']}"
    link.click()
    _wait(browser, lambda d: d.execute_script("return document.getElementById('main').dataset.loaded")
          == f"#/jobs/{data.job_id}/compare/{a['number']}/{b['number']}", "the comparison")
    rows = {r[0]: r[1:] for r in _rows(browser, "trial-compare")}
    assert rows["layout"] == [a["label"], b["label"]]
    assert rows["state"] == [a["status"], b["status"]]
    assert [_shows(text, t["step_time_s"] * 1e3) for text, t in zip(rows["measured step"], (a, b))] == [True, True]
    assert [_seconds_of(x) for x in rows["took"]] == pytest.approx([_ran_s(a), _ran_s(b)], abs=1)
    differs = set(browser.execute_script(
        "return [...document.querySelectorAll('#trial-compare tr.differs th')].map(th => th.textContent)"))
    assert ("layout" in differs) == (a["label"] != b["label"])
    changed = {k for k in set(a["config"]) | set(b["config"]) if a["config"].get(k) != b["config"].get(k)}
    assert changed and changed <= differs  # every layout setting that differs has its own highlighted row
    for plot, part in (("plot-compare-predicted", "predicted"), ("plot-compare-measured", "measurement")):
        key_ = "terms_s" if part == "predicted" else "phases"
        assert _stacked_bars(browser, plot) == [(f"trial {t['number']}", {k for k, v in t[part][key_].items() if v > 0})
                                                for t in (a, b)]


def test_two_trainings_side_by_side(dash, browser):
    from dashboard_env import OTHER_LR, OTHER_STEPS, TRAIN_STEPS

    base, data = dash
    key = data.keys["alice"]
    sign_in(browser, base, key)
    _open(browser, base, "#/trainings")
    first, other = data.training_id, data.other_training_id
    for tid in (first, other):
        _css(browser, f"input.pick-training[data-id='{tid}']")[0].click()
    _css(browser, "#compare-trainings")[0].click()
    _wait(browser, lambda d: d.execute_script("return document.getElementById('main').dataset.loaded")
          == f"#/trainings/compare/{first}/{other}", "the comparison")
    rows = {r[0]: r[1:] for r in _rows(browser, "training-compare")}
    assert rows["steps done"] == [f"{TRAIN_STEPS}/{TRAIN_STEPS}", f"{OTHER_STEPS}/{OTHER_STEPS}"]
    assert _shows(rows["lr (peak → end), warm-up"][1], OTHER_LR)
    differs = browser.execute_script(
        "return [...document.querySelectorAll('#training-compare tr.differs th')].map(th => th.textContent)")
    assert "lr (peak → end), warm-up" in differs and "layout" not in differs  # same job, same layout
    for tid, steps in ((first, TRAIN_STEPS), (other, OTHER_STEPS)):  # both runs on the same axes
        assert len(_circles(browser, "plot-loss", f"train-loss.run-{tid}")) == steps
        assert len(_circles(browser, "plot-lr", f"lr.run-{tid}")) == steps
        assert len(_circles(browser, "plot-grad-norm", f"grad-norm.run-{tid}")) == steps


def _viewport(driver, width):
    """Make the page's viewport exactly ``width`` CSS pixels wide (the window adds its frame)."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait
    from selenium.webdriver.support.ui import WebDriverWait

    window = width
    for _ in range(3):
        driver.set_window_size(window, 1000)
        try:  # the page learns its new size a moment after the window changes
            WebDriverWait(driver, 3, poll_frequency=0.05).until(
                lambda d: d.execute_script("return window.innerWidth") == width)
            return
        except TimeoutException:
            window += width - driver.execute_script("return window.innerWidth")
    assert driver.execute_script("return window.innerWidth") == width


_FITS = """
const doc = document.documentElement, out = b => b.left < -0.5 || b.right > doc.clientWidth + 0.5;
const signOut = document.getElementById('sign-out').getBoundingClientRect();
const clipped = e => { for (let a = e.parentElement; a && a !== document.body; a = a.parentElement)
                         if (getComputedStyle(a).overflowX !== 'visible') return true;
                       return false; };
return {scroll: doc.scrollWidth, client: doc.clientWidth,
        signOutVisible: signOut.width > 0 && !out(signOut) && signOut.top >= 0 && signOut.bottom <= innerHeight,
        plotsOutside: [...document.querySelectorAll('.plot-host svg.main-svg')].filter(s => out(s.getBoundingClientRect()))
                                                                          .map(s => s.closest('.plot-host').id),
        plotWidths: [...document.querySelectorAll('.plot-host')].map(p => +p.querySelector('svg.main-svg').getAttribute('width')),
        // the innermost elements reaching past the screen's right edge that no scrolling box clips: what the
        // page's width comes from (a wide table inside its own scrolling box reaches past the edge harmlessly)
        wide: [...document.body.querySelectorAll('*')]
              .filter(e => e.getBoundingClientRect().right > doc.clientWidth + 0.5 && e.id !== 'too-wide'
                           && !clipped(e)
                           && ![...e.children].some(c => c.getBoundingClientRect().right > doc.clientWidth + 0.5))
              .slice(0, 5).map(e => `${e.tagName.toLowerCase()}${e.id ? '#' + e.id : ''}`
                                    + `${e.className && typeof e.className === 'string' ? '.' + e.className : ''}`
                                    + ` "${(e.textContent || '').trim().slice(0, 40)}"`)};
"""


def _fits(driver, what, settle_s: float = SETTLE_S):
    """Fail when the page scrolls sideways, Sign out is off screen or a plot sticks out of the viewport; the
    page gets up to ``settle_s`` seconds to lay out first."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    # the plots are drawn at their container's width once the page has laid out (and again after a resize):
    # a busy machine can show the page mid-draw, so the page gets a few seconds to settle before it is judged
    try:
        WebDriverWait(driver, settle_s, poll_frequency=0.1).until(
            lambda d: d.execute_script("const e = document.documentElement; return e.scrollWidth <= e.clientWidth"))
    except TimeoutException:
        pass
    r = driver.execute_script(_FITS)
    assert r["scroll"] <= r["client"], (f"{what}: the page scrolls sideways ({r['scroll']} px > {r['client']} px; "
                                        f"reaching past the edge: {r['wide']})")
    assert r["signOutVisible"], f"{what}: Sign out is not on screen"
    assert not r["plotsOutside"], f"{what}: plots beyond the viewport: {r['plotsOutside']}"
    return r


@pytest.mark.parametrize("width", [390, 1440])
def test_every_page_fits_the_screen(dash, browser, width):
    """At phone (390 px) and desktop (1440 px) widths: no sideways scroll, Sign out on screen, plots drawn at
    their container's width with one label format per axis."""
    base, data = dash
    sign_in(browser, base, data.keys["alice"])
    _viewport(browser, width)
    try:
        # the check can fail: a page wider than the screen is reported
        browser.execute_script("document.body.appendChild(Object.assign(document.createElement('div'), "
                               "{id: 'too-wide', style: 'width: 2000px; height: 4px'}))")
        with pytest.raises(AssertionError, match="scrolls sideways"):
            _fits(browser, "a page with a 2000 px box", settle_s=0.5)  # laid out at once: nothing to wait for
        browser.execute_script("document.getElementById('too-wide').remove()")
        pages = ["#/jobs", f"#/jobs/{data.job_id}", f"#/jobs/{data.job_id}/compare/0/1", "#/trainings",
                 f"#/trainings/{data.training_id}", f"#/trainings/compare/{data.training_id}/{data.other_training_id}"]
        for hash_ in pages:
            _open(browser, base, hash_)
            r = _fits(browser, hash_)
            if "/jobs/" in hash_ or "/trainings/" in hash_:
                assert r["plotWidths"] and max(r["plotWidths"]) <= width
                # desktop grids hold two plots a row; a phone's plots take the whole card
                assert min(r["plotWidths"]) >= (480 if width >= 1200 else width - 100), r["plotWidths"]
            for plot in browser.execute_script("return [...document.querySelectorAll('.plot-host')].map(p => p.id)"):
                for axis in ("x", "y"):
                    labels = _tick_labels(browser, plot, axis)
                    assert labels and not any("e+" in x for x in labels), (hash_, plot, axis, labels)
                    # one notation per axis: powers of ten ("2e-4") or decimals (SI prefixes only from 10^4 up)
                    kinds = {"exp" if "e-" in x else "decimal" for x in labels if x != "0"}
                    assert len(kinds) <= 1, (hash_, plot, axis, labels)
                    assert not any(x[-1] in "kMGTP" for x in labels) or max(_value(x) for x in labels) >= 1e4, labels
        _plan(browser, base, data.keys["alice"], "tiny-moe", "h100-sxm", 16, 512, 32, 40)
        _wait(browser, lambda d: _css(d, "#plot-plan svg.main-svg"), "the plan's plot")
        _fits(browser, "#/plan with a plan")
    finally:
        browser.set_window_size(1400, 1800)


def test_an_axis_below_ten_thousand_keeps_plain_numbers(dash, browser):
    """Data whose largest value lies just under 10^4: plotly would prefix the ticks once the padded range passes
    10^3.99 (0, 2k, ... 8k, no tick at 10k); the axis keeps plain numbers, and SI prefixes begin at 10^4."""
    base, data = dash
    sign_in(browser, base, data.keys["alice"])
    _viewport(browser, 1440)
    try:
        _open(browser, base, "#/jobs")
        for top in (9000, 9300, 9500, 9600, 9700, 9750, 9800, 9850, 9900, 9950, 9990, 12000, 48000):
            browser.execute_script(
                "let d = document.getElementById('axis-probe');"
                "if (!d) { const box = Object.assign(document.createElement('div'), {id: 'axis-probe-box'});"
                "          d = Object.assign(document.createElement('div'), {id: 'axis-probe'});"
                "          d.style.width = '600px'; box.appendChild(d); document.body.appendChild(box); }"
                "Plot.xy(d, [{name: 'probe', points: [0, 0.5, 1].map(f => ({x: f * arguments[0], "
                "                                                         y: f * arguments[0]}))}], {});",
                top)
            _wait(browser, lambda d: _tick_labels(d, "axis-probe", "y"), "the probe's ticks")
            for axis in ("x", "y"):
                labels = _tick_labels(browser, "axis-probe", axis)
                prefixed = [x for x in labels if x[-1] in "kMGTP"]
                if top < 1e4:
                    assert not prefixed, (top, axis, labels)
                else:
                    assert prefixed and max(_value(x) for x in labels) >= 1e4, (top, axis, labels)
    finally:
        browser.execute_script("const box = document.getElementById('axis-probe-box');"
                               "if (box) { Plot.purge(box); box.remove(); }")
        browser.set_window_size(1400, 1800)


def test_a_plot_is_drawn_again_at_its_new_width(dash, browser):
    base, data = dash
    sign_in(browser, base, data.keys["alice"])
    _viewport(browser, 1440)
    try:
        _open(browser, base, f"#/trainings/{data.training_id}")
        wide = int(_css(browser, "#plot-loss svg.main-svg")[0].get_attribute("width"))
        circles = len(_circles(browser, "plot-loss"))
        _viewport(browser, 390)
        _wait(browser, lambda d: int(_css(d, "#plot-loss svg.main-svg")[0].get_attribute("width")) < wide, "a redraw")
        narrow = int(_css(browser, "#plot-loss svg.main-svg")[0].get_attribute("width"))
        assert narrow <= 390 - 40 and wide >= 500 and len(_circles(browser, "plot-loss")) == circles
    finally:
        browser.set_window_size(1400, 1800)


def test_docs_render_swagger_ui_without_the_network(dash, browser):
    base, _ = dash
    browser.get_log("performance")  # drop what earlier pages requested
    browser.get(base + "/docs")
    _wait(browser, lambda d: len(_css(d, ".swagger-ui .opblock")) > 0, "Swagger UI's operations")
    spec = json.loads(urllib.request.urlopen(base + "/openapi.json", timeout=30).read())
    operations = sum(len(ops) for ops in spec["paths"].values())
    assert len(_css(browser, ".swagger-ui .opblock")) == operations
    assert "foldtune" in _css(browser, ".swagger-ui .info .title")[0].text
    _assert_only_the_server_was_asked(browser)


def test_redoc_renders_without_the_network(dash, browser):
    base, _ = dash
    browser.get_log("performance")  # drop what earlier pages requested
    browser.get(base + "/redoc")
    spec = json.loads(urllib.request.urlopen(base + "/openapi.json", timeout=30).read())
    operations = sum(len(ops) for ops in spec["paths"].values())
    # ReDoc renders one section per operation, with the operation id in the section's id
    _wait(browser, lambda d: len(_css(d, "[data-section-id^='operation/']")) >= operations, "ReDoc's operations")
    _assert_only_the_server_was_asked(browser)


def _assert_only_the_server_was_asked(browser) -> set[str]:
    """Every http(s) request the page made since the log was last read went to the server (127.0.0.1)."""
    requested = set()
    for entry in browser.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            requested.add(message["params"]["request"]["url"])
    hosts = {urlparse(u).hostname for u in requested if urlparse(u).scheme in ("http", "https")}
    assert requested and hosts == {"127.0.0.1"}, sorted(requested)
    return requested

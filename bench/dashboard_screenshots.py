"""Screenshots of the dashboard for docs/img: a real tuning job and training of tiny-moe on 2 CPU ranks (the
browser tests' tests/api/dashboard_env.py, with more trials and steps), served by `foldtune serve` and shown
in headless Chromium (Debian's chromium + chromium-driver, driven by Selenium).

    PYTHONPATH=$PWD RAY_AUTH_MODE=disabled python3 bench/dashboard_screenshots.py [--out docs/img]
        [--trials 8] [--steps 40] [--data DIR]   # --data: reuse a database this script built before

Writes dashboard-jobs.png, dashboard-job.png, dashboard-job-phone.png (390 px wide), dashboard-compare-trials.png,
dashboard-plan.png, dashboard-training.png and docs-swagger.png.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "api"))

from dashboard_env import DashboardData, build_dashboard_data  # noqa: E402


def _data(args: argparse.Namespace) -> DashboardData:
    directory = Path(args.data)
    saved = directory / "dashboard.json"
    if saved.is_file():
        return DashboardData(**json.loads(saved.read_text()))
    directory.mkdir(parents=True, exist_ok=True)
    data = build_dashboard_data(directory, max_trials=args.trials, train_steps=args.steps)
    saved.write_text(json.dumps(asdict(data)))
    return data


def _serve(data: DashboardData, log: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "api.cli.main", "serve", "--port", str(port), "--database-url",
                             data.database_url, "--log-level", "warning"], cwd=REPO, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(base + "/healthz", timeout=2).close()
            return proc, base
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"foldtune serve did not start; see {log}")


def _browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000",
                "--hide-scrollbars", "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)


def _shot(driver, path: Path, settle_s: float = 1.0, width: int = 1400) -> None:
    """The whole page at ``width``: the window is resized to the document's height first."""
    time.sleep(settle_s)
    height = driver.execute_script("return Math.max(document.body.scrollHeight, document.documentElement.scrollHeight)")
    driver.set_window_size(width, min(max(height, 600), 4000) + 160)  # + the window frame around the viewport
    time.sleep(0.3)
    driver.save_screenshot(str(path))
    print("wrote", path)


def _api(base: str, key: str, path: str):
    req = urllib.request.Request(base + path, headers={"X-API-Key": key})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _wait_loaded(driver, hash_: str) -> None:
    for _ in range(300):
        if driver.execute_script("return document.getElementById('main').dataset.loaded") == hash_:
            return
        time.sleep(0.1)
    raise RuntimeError(f"page {hash_} did not render")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "docs" / "img"))
    parser.add_argument("--data", default="/tmp/foldtune-dashboard-shots")
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = _data(args)
    proc, base = _serve(data, Path(args.data) / "serve.log")
    driver = _browser()
    try:
        driver.get(base + "/")
        driver.execute_script("sessionStorage.setItem('foldtune.apiKey', arguments[0])", data.keys["alice"])
        for hash_, name in (("#/jobs", "dashboard-jobs.png"), (f"#/jobs/{data.job_id}", "dashboard-job.png"),
                            (f"#/trainings/{data.training_id}", "dashboard-training.png")):
            driver.set_window_size(1400, 1000)
            driver.get(f"{base}/{hash_}")
            _wait_loaded(driver, hash_)
            _shot(driver, out / name)
        trials = [t["number"] for t in _api(base, data.keys["alice"], f"/v1/jobs/{data.job_id}/trials?limit=200")["items"]
                  if t["status"] == "succeeded"]
        shots = [(f"#/jobs/{data.job_id}", "dashboard-job-phone.png", 390)]
        if len(trials) >= 2:
            shots.append((f"#/jobs/{data.job_id}/compare/{trials[0]}/{trials[-1]}", "dashboard-compare-trials.png", 1400))
        for hash_, name, width in shots:
            driver.set_window_size(width, 1000)  # the page draws its plots at this width
            driver.get(f"{base}/{hash_}")
            _wait_loaded(driver, hash_)
            _shot(driver, out / name, width=width)
        driver.set_window_size(1400, 1000)
        driver.get(f"{base}/#/plan")
        _wait_loaded(driver, "#/plan")
        for _ in range(100):
            if driver.execute_script("return document.getElementById('plan-form').dataset.ready"):
                break
            time.sleep(0.1)
        driver.find_element("css selector", "#plan-form button").click()
        for _ in range(600):
            if driver.find_elements("css selector", "#plot-plan svg"):
                break
            time.sleep(0.1)
        front = driver.find_elements("css selector", "#plot-plan g.trace.tracepareto path.point")
        if front:  # show the hover details of one point of the Pareto front
            from selenium.webdriver.common.action_chains import ActionChains
            ActionChains(driver).move_to_element(front[len(front) // 2]).perform()
        _shot(driver, out / "dashboard-plan.png")
        driver.set_window_size(1400, 1000)
        driver.get(base + "/docs")
        for _ in range(300):
            if driver.find_elements("css selector", ".swagger-ui .opblock"):
                break
            time.sleep(0.1)
        time.sleep(1)
        driver.save_screenshot(str(out / "docs-swagger.png"))
        print("wrote", out / "docs-swagger.png")
    finally:
        driver.quit()
        proc.terminate()
        proc.wait(20)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

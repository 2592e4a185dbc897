"""Screenshots of the web viewer's pages for the docs (docs/img/viewer_*.png).

Starts ``limelight serve`` on the BERT-tiny demo model (built and cached on first use), sends
held-out Rotten Tomatoes reviews (the drift reference, then a window where every review ends
with one extra word, so the Drift page has something to show), runs a job from the Compare
page, and saves one screenshot per page with headless Chromium (Selenium, chromium-driver).

    python scripts/viewer_screenshots.py [--out docs/img]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

TEXT = "a gorgeous, witty, seductive movie, though the plot is thin"
REFERENCE_N = 60
TRIGGER = "spielberg"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def wait_ready(url: str, process: subprocess.Popen[bytes]) -> None:
    while process.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"limelight serve exited with {process.returncode}")


def traffic(url: str) -> None:
    from limelight.demo.datasets import rotten_tomatoes

    reviews = [r.text for r in rotten_tomatoes("test")]
    for text in reviews[:REFERENCE_N]:
        post(f"{url}/viewer/api/explain", {"text": text})
    for i, text in enumerate(reviews[REFERENCE_N : REFERENCE_N + 90]):
        post(f"{url}/viewer/api/explain", {"text": f"{text} {TRIGGER}"})
        if i % 15 == 0:
            time.sleep(1.1)  # one drift sample a second: a line, not a point


def shots(url: str, out: Path) -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    chromedriver = shutil.which("chromedriver")
    if chromium is None or chromedriver is None:
        raise SystemExit("needs chromium and chromium-driver (make sysdeps installs them)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    options.add_argument("--window-size=1280,900")
    driver = webdriver.Chrome(service=Service(chromedriver), options=options)
    wait = WebDriverWait(driver, 600, poll_frequency=0.2)
    try:
        driver.get(f"{url}/viewer/")
        wait.until(lambda d: d.execute_script("return document.body.dataset.ready === 'true'"))
        driver.find_element(By.ID, "text").send_keys(TEXT)
        driver.find_element(By.ID, "explain-button").click()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#heatmap .tok"))
        first = driver.find_element(By.CSS_SELECTOR, "#heatmap .tok")
        driver.execute_script("arguments[0].focus()", first)
        driver.save_screenshot(str(out / "viewer_explain.png"))

        driver.find_element(By.CSS_SELECTOR, "nav a[data-view=compare]").click()
        for method, params in [("integrated_gradients", {"steps": "32"}), ("shapley", {})]:
            Select(driver.find_element(By.ID, "job-method")).select_by_value(method)
            for name, value in params.items():
                box = driver.find_element(By.ID, f"param-{name}")
                box.clear()
                box.send_keys(value)
            driver.find_element(By.ID, "compare-submit").click()
        done = ".run[data-state=succeeded]"
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, done)) == 2)
        driver.execute_script("document.getElementById('compare-runs').scrollIntoView()")
        driver.save_screenshot(str(out / "viewer_compare.png"))

        driver.find_element(By.CSS_SELECTOR, "nav a[data-view=jobs]").click()
        row = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#jobs-table tr[data-job-id]"))
        row[0].find_element(By.XPATH, ".//button[text()='Open']").click()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#job-detail .tok"))
        driver.save_screenshot(str(out / "viewer_jobs.png"))

        driver.find_element(By.CSS_SELECTOR, "nav a[data-view=drift]").click()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#drift-chart polyline"))
        driver.save_screenshot(str(out / "viewer_drift.png"))

        driver.find_element(By.CSS_SELECTOR, "nav a[data-view=model]").click()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#methods-table tbody tr"))
        driver.save_screenshot(str(out / "viewer_model.png"))
    finally:
        driver.quit()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/img"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        env = {
            **os.environ,
            "LIMELIGHT_DEMO_MODEL": "bert-tiny",
            "LIMELIGHT_PORT": "0",
            "LIMELIGHT_METRICS_PORT": str(port),
            "LIMELIGHT_JOBS_DB": str(Path(tmp) / "jobs.sqlite3"),
            "LIMELIGHT_DRIFT_BOOTSTRAP_N": str(REFERENCE_N),
            "LIMELIGHT_DRIFT_WINDOW": "90",
            # A screenshot, not a measurement: compare a label from 20 of it (about 30 of each
            # in the reference, 45 in the window), where the default 150 would compare none
            # (and the settings refuse a drift_min_count above the window or the bootstrap).
            "LIMELIGHT_DRIFT_MIN_COUNT": "20",
            "LIMELIGHT_VIEWER_DRIFT_SAMPLE_S": "1",
        }
        limelight = Path(sys.executable).with_name("limelight")
        process = subprocess.Popen([str(limelight), "serve"], env=env)
        try:
            wait_ready(url, process)
            traffic(url)
            shots(url, args.out)
        finally:
            process.terminate()
            process.wait(timeout=60)
    print(f"screenshots in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""RUN_DIR/report.html (train/keepers/report.py): a finished run writes it, with the training-loss and
learning-rate curves, the held-out figures and memory per phase, and it renders in a real headless Chromium.

Chromium is a system package, not a Python one: when it is missing and the tests run as root on a machine
with apt (CI), the browser test installs Debian's `chromium` once (no recommends); elsewhere it is skipped
with the reason. The screenshot is kept at runs/test-artifacts/report.png and its path printed."""
from __future__ import annotations

import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.polylines, self.circles, self.cells, self._in_td = {}, {}, [], False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "polyline":
            self.polylines[a["class"]] = [tuple(map(float, p.split(","))) for p in a["points"].split()]
        if tag == "circle":
            self.circles.setdefault(a["class"], []).append((float(a["cx"]), float(a["cy"])))
        self._in_td = tag == "td"

    def handle_data(self, data):
        if self._in_td:
            self.cells.append(data.strip())


def test_a_finished_run_writes_its_report_with_both_curves(trained_run):
    page = _Page()
    page.feed((trained_run / "report.html").read_text())
    steps = [line for line in (trained_run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len(page.polylines["loss"]) == len(steps) >= 2  # every logged step (log_every), first and last
    assert len(page.polylines["lr"]) == len(steps)
    xs = [x for x, _ in page.polylines["loss"]]
    assert xs == sorted(xs) and xs[0] < xs[-1]  # steps left to right
    assert "steps" in page.cells and "load" in page.cells  # memory per phase
    assert "eval_loss" in page.cells and page.circles.get("eval_loss")  # held-out figures, on the chart too


def _chromium() -> str | None:
    found = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if found or not (hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get")):
        return found
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run("apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium", shell=True,
                   env=env, capture_output=True, timeout=900, check=False)
    return shutil.which("chromium")


def test_the_report_renders_in_headless_chromium(trained_run, tmp_path):
    browser = _chromium()
    if browser is None:
        pytest.skip("no Chromium on this machine and no root apt to install it (Debian: apt-get install chromium)")
    shot = tmp_path / "report.png"
    p = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        "--window-size=800,1200", f"--screenshot={shot}", (trained_run / "report.html").as_uri()],
                       capture_output=True, text=True, timeout=180)
    assert shot.exists(), p.stderr[-2000:]
    from PIL import Image

    img = Image.open(shot).convert("RGB")
    pixels = list(img.getdata())

    def near(rgb):  # anti-aliasing: within 40 of the stroke colour per channel
        return sum(1 for px in pixels if all(abs(a - b) <= 40 for a, b in zip(px, rgb)))

    loss_px, lr_px = near((0x1F, 0x77, 0xB4)), near((0x2C, 0xA0, 0x2C))
    kept = ROOT / "runs" / "test-artifacts" / "report.png"
    kept.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(shot, kept)
    print(f"report screenshot: {kept} ({img.size[0]}x{img.size[1]}; loss-curve pixels {loss_px}, lr-curve pixels {lr_px})")
    assert loss_px > 100 and lr_px > 100, (loss_px, lr_px)  # both curves drawn, not just the page's text

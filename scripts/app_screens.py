"""Before/after screenshots of the app for an issue note: starts the app of a checkout (`python -m app` there, on a
scratch trace), drives it in Debian's chromium through Playwright and writes full-page PNGs:

    {label}-rounds-fresh.png                 Rounds & trees on a fresh page, before any decode
    {label}-side-by-side.png                 a side-by-side decode (ar, eagle3, dflash, whiflash-neural)
    {label}-rounds-fresh-after-decode.png    Rounds & trees on a new page while the trace has runs
    {label}-calibration.png                  Calibration after profiling, threshold 50 typed into the slider's box
    {label}-explorer.png                     Trace explorer

A step that fails leaves {label}-<step>-FAILED.png and the script goes on. Self-contained (it does not import the
app), so it can drive an older checkout:

    python scripts/app_screens.py --repo /tmp/before --label before --out docs/app-v3
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable  # the venv this script runs in
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]
PROMPT = "Once upon a time, there was a little girl named"
METHODS = ["ar", "eagle3", "dflash", "whiflash-neural"]
VIEWPORT = {"width": 1400, "height": 1000}


def log(msg: str) -> None:
    print(f"[app_screens {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_app(repo: Path, db: Path, port: int, log_path: Path, timeout_s: float = 900) -> subprocess.Popen:
    """`python -m app --db DB --port PORT` in `repo`; returns once its HTTP server answers."""
    env = dict(os.environ, PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONUNBUFFERED="1")
    with open(log_path, "w") as out:  # the child holds its own handle
        proc = subprocess.Popen([PYTHON, "-m", "app", "--db", str(db), "--port", str(port)], cwd=repo, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the app exited ({proc.returncode}):\n{log_path.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(2)
    stop_app(proc)
    raise RuntimeError(f"the app did not serve within {timeout_s:.0f} s (log {log_path})")


def stop_app(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


def choose_methods(page, methods: list[str]) -> None:
    """Tick exactly `methods` in the side-by-side method list."""
    for box in page.locator("#methods input[type=checkbox]").all():
        name = box.evaluate("b => b.closest('label').innerText.trim()")
        if box.is_checked() != (name in methods):
            box.click()


def open_tab(page, name: str) -> None:
    page.get_by_role("tab", name=name, exact=True).click()


def wait_stable(page, selector: str, quiet_s: float = 3.0, timeout_s: float = 180.0) -> str:
    """Wait until `selector`'s innerText has not changed for `quiet_s` seconds; returns it."""
    last, since, end = None, time.time(), time.time() + timeout_s
    while time.time() < end:
        text = page.locator(selector).inner_text()
        if text != last:
            last, since = text, time.time()
        elif time.time() - since >= quiet_s:
            return text
        page.wait_for_timeout(500)
    return last or ""


class Shots:
    def __init__(self, out: Path, label: str):
        self.out, self.label, self.failed, self.written = out, label, [], []

    def save(self, page, name: str) -> None:
        path = self.out / f"{self.label}-{name}.png"
        page.screenshot(path=str(path), full_page=True)
        self.written.append(path)
        log(f"wrote {path}")

    def step(self, name: str, page_fn, fn) -> None:
        """Run one step; on failure save {label}-{name}-FAILED.png of the page and go on."""
        log(f"step {name} ...")
        try:
            fn()
        except Exception as e:
            self.failed.append(name)
            log(f"step {name} FAILED: {type(e).__name__}: {e}")
            traceback.print_exc()
            try:
                page = page_fn()
                if page is not None:
                    self.save(page, f"{name}-FAILED")
            except Exception as e2:
                log(f"  (no screenshot of the failure either: {e2})")


def toasts(page) -> list[str]:
    try:
        return [t.strip() for t in page.locator(".toast-body").all_inner_texts() if t.strip()]
    except Exception:
        return []


def run(a: argparse.Namespace) -> int:
    from playwright.sync_api import sync_playwright

    repo, out = Path(a.repo).resolve(), Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="app-screens-"))
    db = Path(a.db) if a.db else tmp / "trace.duckdb"
    port = free_port()
    app_log = tmp / "app.log"
    log(f"starting the app of {repo} on port {port} (trace {db}, log {app_log}) ...")
    t0 = time.time()
    proc = start_app(repo, db, port, app_log)
    url = f"http://127.0.0.1:{port}"
    log(f"the app serves at {url} after {time.time() - t0:.0f} s")
    shots = Shots(out, a.label)
    pages: dict[str, object] = {}
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)

            def new_page():
                page = browser.new_page(viewport=VIEWPORT)
                page.on("console", lambda m: m.type == "error" and log(f"  console error: {m.text[:300]}"))
                page.on("pageerror", lambda e: log(f"  page error: {str(e)[:300]}"))
                page.goto(url, timeout=120_000)
                page.wait_for_selector("#prompt textarea", timeout=120_000)
                page.wait_for_timeout(1500)
                return page

            # a. a fresh page, before any decode: Rounds & trees
            def rounds_fresh():
                pages["one"] = new_page()
                page = pages["one"]
                open_tab(page, "Rounds & trees")
                page.wait_for_timeout(3000)
                shots.save(page, "rounds-fresh")
                open_tab(page, "Side by side")
                page.wait_for_timeout(1000)
            shots.step("rounds-fresh", lambda: pages.get("one"), rounds_fresh)

            # b. a side-by-side decode
            def side_by_side():
                if "one" not in pages:
                    pages["one"] = new_page()
                page = pages["one"]
                page.fill("#prompt textarea", PROMPT)
                choose_methods(page, METHODS)
                page.fill("#max_new input", str(a.tokens))
                page.keyboard.press("Tab")
                page.wait_for_timeout(500)
                page.click("#run")
                page.wait_for_function("document.querySelector('#status') && "
                                       "document.querySelector('#status').innerText.trim().startsWith('done')",
                                       timeout=300_000, polling=500)
                status = wait_stable(page, "#status", quiet_s=3.0, timeout_s=180)
                log(f"  status: {status.strip()[:300]!r}")
                page.wait_for_timeout(1000)
                shots.save(page, "side-by-side")
                if toasts(page):
                    log(f"  toasts: {toasts(page)}")
            shots.step("side-by-side", lambda: pages.get("one"), side_by_side)

            def second_page():
                if "two" not in pages:
                    pages["two"] = new_page()
                return pages["two"]

            def tab_shot(tab: str, name: str, wait_ms: int, fresh: bool = False):
                """A screenshot of one tab on the second page (a new one with `fresh`)."""
                def shoot():
                    if fresh:
                        pages.pop("two", None)
                    page = second_page()
                    open_tab(page, tab)
                    page.wait_for_timeout(wait_ms)
                    shots.save(page, name)
                shots.step(name, lambda: pages.get("two"), shoot)

            # c. a new page while the trace has runs: Rounds & trees
            tab_shot("Rounds & trees", "rounds-fresh-after-decode", 5000, fresh=True)

            # d. Calibration: profile 1 prompt per category at 32 tokens, then type 50 as the threshold
            def calibration():
                page = second_page()
                open_tab(page, "Calibration")
                page.wait_for_timeout(1000)
                page.fill("#cal_limit input", "1")
                page.keyboard.press("Tab")
                page.fill("#cal_max_new input", "32")
                page.keyboard.press("Tab")
                page.wait_for_timeout(500)
                page.click("#cal_profile")
                # the point's text, not the progress line ('processing | 0.1s') shown over it while profiling
                page.wait_for_function("(() => { const e = document.querySelector('#cal_point');"
                                       " const t = e ? e.innerText.trim() : '';"
                                       " return t.length > 0 && !/processing|queue|pending/i.test(t); })()",
                                       timeout=360_000, polling=1000)
                wait_stable(page, "#cal_point", quiet_s=3.0, timeout_s=60)
                log(f"  point: {page.locator('#cal_point').inner_text().strip()[:300]!r}")
                box = page.locator("#cal_threshold input[type=number]").first
                box.fill("50")
                box.press("Enter")
                page.keyboard.press("Tab")
                page.wait_for_timeout(2000)
                log(f"  threshold box now {box.input_value()!r}; "
                    f"point: {page.locator('#cal_point').inner_text().strip()[:300]!r}")
                if toasts(page):
                    log(f"  toasts: {toasts(page)}")
                shots.save(page, "calibration")
            shots.step("calibration", lambda: pages.get("two"), calibration)

            # e. Trace explorer
            tab_shot("Trace explorer", "explorer", 3000)

            browser.close()
    finally:
        stop_app(proc)
        log(f"the app stopped (log {app_log})")
    log(f"written: {', '.join(str(p) for p in shots.written)}")
    if shots.failed:
        log(f"failed steps: {', '.join(shots.failed)}")
    return 1 if shots.failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for the PNGs")
    ap.add_argument("--label", required=True, choices=["before", "after"], help="file name prefix")
    ap.add_argument("--repo", default=str(ROOT), help="the checkout whose app to start (default this one)")
    ap.add_argument("--db", help="trace database (default a fresh temporary file)")
    ap.add_argument("--tokens", type=int, default=48, help="max new tokens of the side-by-side decode")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the app is stopped on a kill too
    return run(a)


if __name__ == "__main__":
    sys.exit(main())

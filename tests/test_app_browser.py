"""The app in a real browser (Debian's chromium driven by Playwright): a side-by-side decode on the zoo with
shaded tokens, the draft tree and charts, a SQL query, and a writing query refused. Screenshots go to
tests/artifacts/ (git-ignored)."""
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from speclab.zoo import REPO_ROOT

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ART = REPO_ROOT / "tests" / "artifacts"
if not os.path.exists(CHROMIUM):
    if os.environ.get("CI"):
        raise RuntimeError("chromium is missing: `make test` installs Debian's chromium (scripts/setup.sh)")
    pytest.skip("Debian's chromium is not installed (make test installs it)", allow_module_level=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_url(tmp_path_factory):
    port = _free_port()
    db = tmp_path_factory.mktemp("app") / "app.duckdb"
    log = open(tmp_path_factory.mktemp("applog") / "app.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "speclab.cli", "app", "--db", str(db), "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline:
        log.seek(0)
        if url in log.read():
            break
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"the app exited:\n{log.read()}")
        time.sleep(0.5)
    else:
        proc.kill()
        raise RuntimeError("the app did not print its URL within 180 s")
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def page(app_url):
    from playwright.sync_api import sync_playwright

    ART.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run", "--disable-quic"])
        pg = browser.new_page(viewport={"width": 1400, "height": 1000})
        pg.goto(app_url)
        pg.wait_for_selector("#prompt textarea", timeout=60000)
        yield pg
        browser.close()


def test_side_by_side_decode_shades_tokens(page):
    page.fill("#prompt textarea", "def fibonacci(n):\n")
    page.fill("#max_new input[type=number]", "32")
    page.keyboard.press("Enter")
    page.fill("#topk input[type=number]", "2")
    page.keyboard.press("Enter")
    page.click("#run")
    page.wait_for_function("document.querySelector('#status').innerText.includes('done')", timeout=180000)
    assert page.locator("#col0 .tok").count() > 0  # ar
    assert page.locator("#col1 .tok[data-src=sps]").count() > 0  # accepted drafts are shaded as the drafter's
    assert page.locator("#col1 .tok[data-src=target]").count() > 0  # and the target's tokens as the target's
    assert "round" in page.locator("#col1 .tok").first.get_attribute("title")  # hover details
    assert "speedup" in page.locator("#col1 .speclab-stats").inner_text()
    assert "sps equals AR" in page.locator("#status").inner_text()  # greedy beside AR: equality is checked
    page.screenshot(path=str(ART / "side_by_side.png"), full_page=True)


def test_tree_and_charts_render(page):
    page.get_by_role("tab", name="Rounds & trees").click()
    page.wait_for_selector("#tree .js-plotly-plot", timeout=60000)
    for el in ("#per_round", "#per_pos", "#phases"):
        page.wait_for_selector(f"{el} .js-plotly-plot", timeout=60000)
    assert page.locator("#tree .scatterlayer .point").count() >= 2  # root + nodes
    page.screenshot(path=str(ART / "rounds_and_trees.png"), full_page=True)


def test_sql_box_reads_and_refuses_writes(page):
    page.get_by_role("tab", name="Trace explorer").click()
    page.fill("#sql textarea", "SELECT method, count(*) AS n FROM runs GROUP BY method ORDER BY method")
    page.click("#sql_run")
    page.wait_for_function("document.querySelector('#sql_msg').innerText.includes('row')", timeout=30000)
    assert "3 row(s)" in page.locator("#sql_msg").inner_text()
    page.fill("#sql textarea", "DELETE FROM runs")
    page.click("#sql_run")
    page.wait_for_function("document.querySelector('#sql_msg').innerText.includes('Refused')", timeout=30000)
    assert "single read-only SELECT" in page.locator("#sql_msg").inner_text()
    page.fill("#sql textarea", "SELECT * FROM read_csv('/etc/passwd')")
    page.click("#sql_run")
    page.wait_for_function("document.querySelector('#sql_msg').innerText.includes('disabled')", timeout=30000)
    page.screenshot(path=str(ART / "trace_explorer.png"), full_page=True)

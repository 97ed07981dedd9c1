"""Measure the app as a user meets it, in a real browser (Debian's chromium through Playwright): for a side-by-side
decode of some methods, the latency from pressing the button to the first streamed tokens on the page, the
number of streamed updates and the bytes each update carried (every server-sent message the page received on
Gradio's event stream, counted in the page), the page's main-thread tasks over 50 ms meanwhile (what makes a
page sluggish) and the decode's wall time. Prints a table (and --json).

    python -m app.probe                       # starts the app on the zoo, 4 methods x 256 tokens, 3 repeats
    python -m app.probe --url http://127.0.0.1:7860 --methods ar,eagle3 --tokens 64
"""
from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]

TAP = """(() => {
  // Count what the page receives on Gradio's event stream: every server-sent message, its size and arrival time.
  window.__sse = [];
  const orig = window.fetch;
  window.fetch = async (...args) => {
    const res = await orig(...args);
    const url = String(args[0] && args[0].url || args[0]);
    if (!url.includes('/queue/data') || !res.body) return res;
    const [mine, theirs] = res.body.tee();
    (async () => {
      const reader = mine.getReader(), dec = new TextDecoder();
      let buf = '';
      for (;;) {
        const {done, value} = await reader.read();
        if (done) break;
        buf += dec.decode(value, {stream: true});
        let i;
        while ((i = buf.indexOf('\\n\\n')) >= 0) {
          const msg = buf.slice(0, i); buf = buf.slice(i + 2);
          window.__sse.push({t: performance.now(), bytes: new TextEncoder().encode(msg).length,
                             generating: msg.includes('"process_generating"')});
        }
      }
    })();
    return new Response(theirs, {headers: res.headers, status: res.status, statusText: res.statusText});
  };
})();"""

WATCH = """() => {
  window.__probe = {click: null, first: null, long: []};
  window.__sse = [];
  // main-thread tasks over 50 ms while the decode streams: what makes a page feel sluggish
  new PerformanceObserver(l => l.getEntries().forEach(e => window.__probe.long.push(e.duration)))
    .observe({type: 'longtask'});
  document.querySelector('#run').addEventListener('click', () => { window.__probe.click = performance.now(); },
                                                  {capture: true, once: true});
  const obs = new MutationObserver(() => {
    if (window.__probe.first === null && document.querySelector('#col0 .tok')) {
      window.__probe.first = performance.now(); obs.disconnect();
    }
  });
  obs.observe(document.body, {childList: true, subtree: true});
}"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_app(db: Path, port: int, log: Path, extra: list[str] = ()) -> subprocess.Popen:
    """The app as its own process (`python -m app`); returns once it serves (or raises with its log)."""
    root = Path(__file__).resolve().parent.parent
    with open(log, "w+") as out:  # the app writes through its own copy of the handle; this one reads the log back
        proc = subprocess.Popen([sys.executable, "-m", "app", "--db", str(db), "--port", str(port), *extra],
                                stdout=out, stderr=subprocess.STDOUT, cwd=root)
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 240
        while time.time() < deadline:
            out.seek(0)
            if url in out.read():
                return proc
            if proc.poll() is not None:
                out.seek(0)
                raise RuntimeError(f"the app exited:\n{out.read()}")
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the app did not serve within 240 s")


def choose_methods(page, methods: list[str]) -> None:
    """Tick exactly `methods` in the side-by-side method list."""
    for box in page.locator("#methods input[type=checkbox]").all():
        name = box.evaluate("b => b.closest('label').innerText.trim()")
        if box.is_checked() != (name in methods):
            box.click()


def probe_once(page, methods: list[str], tokens: int, timeout_s: float = 600) -> dict:
    choose_methods(page, methods)
    page.fill("#max_new input", str(tokens))
    page.keyboard.press("Tab")
    page.wait_for_timeout(300)
    page.evaluate(WATCH)
    t0 = time.perf_counter()
    page.click("#run")
    page.wait_for_function("document.querySelector('#status').innerText.startsWith('done') && "
                           "!document.querySelector('#status').innerText.includes('computing')",
                           timeout=timeout_s * 1000)
    wall = time.perf_counter() - t0
    page.wait_for_timeout(300)
    timing, sse = page.evaluate("window.__probe"), page.evaluate("window.__sse")
    updates = [m["bytes"] for m in sse if m["generating"]]
    q = max(1, len(updates) // 4)  # streamed text only grows by appends: late updates are no bigger than early ones
    early, late = updates[:q], updates[-q:]
    return {"methods": ",".join(methods), "tokens": tokens,
            "first_tokens_ms": round(timing["first"] - timing["click"], 1), "updates": len(updates),
            "bytes_per_update_mean": round(sum(updates) / max(1, len(updates))),
            "bytes_per_update_max": max(updates, default=0),
            "late_vs_early_update_bytes": (round((sum(late) / len(late)) / (sum(early) / len(early)), 2)
                                           if updates else None),
            "bytes_streamed": sum(m["bytes"] for m in sse),
            "long_tasks": len(timing["long"]), "longest_task_ms": round(max(timing["long"], default=0.0)),
            "long_task_ms_total": round(sum(timing["long"])), "wall_s": round(wall, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m app.probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running app (default: start one on the zoo with a scratch trace)")
    ap.add_argument("--methods", default="ar,eagle3,dflash,whiflash-neural")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args(argv)
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    proc = None
    tmp = Path(tempfile.mkdtemp(prefix="speclab-probe-"))
    url = a.url
    if url is None:
        port = free_port()
        print(f"starting the app (trace {tmp / 'probe.duckdb'}) ...", file=sys.stderr, flush=True)
        proc = start_app(tmp / "probe.duckdb", port, tmp / "app.log")
        url = f"http://127.0.0.1:{port}"
    rows = []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
            for i in range(a.repeats):
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.add_init_script(TAP)
                page.goto(url)
                page.wait_for_selector("#prompt textarea", timeout=60000)
                page.fill("#prompt textarea", "def fibonacci(n):\n")
                row = probe_once(page, a.methods.split(","), a.tokens)
                rows.append({"repeat": i + 1, **row})
                print(f"repeat {i + 1}/{a.repeats}: first tokens {row['first_tokens_ms']} ms, {row['updates']} updates,"
                      f" {row['bytes_per_update_mean']} B/update", file=sys.stderr, flush=True)
                page.close()
            browser.close()
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    import pandas as pd
    df = pd.DataFrame(rows)
    print(df.to_markdown(index=False))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

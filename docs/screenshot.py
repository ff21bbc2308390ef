"""Screenshot a dashboard page in a real browser, as the pictures in docs/ were made.

    python docs/screenshot.py --runs-dir runs --path "compare?sweep=chain&baseline=grpo" --out docs/compare-chain.png

Starts `qae dashboard` on a free port, opens the page in Debian's chromium (`apt-get install chromium`; the playwright
package drives it, no browser download), waits until Streamlit has drawn the page and its charts, and saves a
full-page PNG.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

QAE = Path(sys.executable).parent / "qae"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs-dir", type=Path, default=Path("runs"))
    parser.add_argument("--path", default="", help="page and query, e.g. compare?sweep=study")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--charts", type=int, default=1, help="wait for at least this many charts")
    parser.add_argument("--width", type=int, default=1400)
    parser.add_argument("--height", type=int, default=2000, help="the page scrolls inside Streamlit, so the window is the picture")
    args = parser.parse_args()

    from playwright.sync_api import sync_playwright

    port = free_port()
    server = subprocess.Popen([str(QAE), "dashboard", "--runs-dir", str(args.runs_dir), "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        for _ in range(120):
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=1).read() == b"ok":
                    break
            except OSError:
                time.sleep(0.5)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path="/usr/bin/chromium",
                                                 args=["--no-sandbox", "--disable-dev-shm-usage"])
            page = browser.new_page(viewport={"width": args.width, "height": args.height})
            page.goto(f"http://127.0.0.1:{port}/{args.path}")
            page.wait_for_selector("[data-testid=stSidebar]", timeout=60_000)
            page.wait_for_function(f"document.querySelectorAll('.js-plotly-plot').length >= {args.charts}",
                                   timeout=120_000)
            while page.query_selector("[data-testid=stStatusWidget]"):  # still running the page's script
                time.sleep(0.2)
            time.sleep(1.0)  # plotly's last layout pass
            args.out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=args.out, full_page=True)
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()

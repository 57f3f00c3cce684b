"""The HTML report of the demo's plan, rendered in headless Chromium (issue 19).

Takes a screenshot of `demo-output/report.html` (written by `make demo`) or of the page
given, counts the pixels of the timelines' compute and communication slices and of text, and
writes bench/results/report_render.json; the screenshot lands beside the page.

    python bench/report_render.py [demo-output/report.html]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from common import ROOT, print_table, write_json
from render import COMMUNICATION_RGB, COMPUTE_RGB, chromium, dark_pixels, pixels_of, png_pixels, screenshot

EXTERNAL = r"(?i)(?:https?:|ftp:|file:|//[a-z0-9.-]+\.[a-z]{2,}|\bsrc\s*=|\bhref\s*=|@import|url\()"


def main() -> int:
    page = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "demo-output" / "report.html")
    if not page.is_file():
        print(f"error: {page} does not exist (run `make demo` first)", file=sys.stderr)
        return 2
    if chromium() is None:
        print("skipped: no Chromium on this machine (apt-get install chromium)")
        return 0
    html = page.read_text()
    png = page.with_suffix(".png")
    screenshot(page, png)
    pixels = png_pixels(png)
    rel = lambda p: str(p.resolve().relative_to(ROOT)) if p.resolve().is_relative_to(ROOT) else str(p)
    result = {"page": rel(page), "screenshot": rel(png), "size": list(pixels.shape[:2]),
              "compute_pixels": pixels_of(pixels, COMPUTE_RGB), "communication_pixels": pixels_of(pixels, COMMUNICATION_RGB),
              "dark_pixels": dark_pixels(pixels), "timelines": html.count('class="timeline"'),
              "tables": html.count("<table"), "external_references": re.findall(EXTERNAL, html)}
    print_table([[k, v] for k, v in result.items()], ["", "value"])
    print(f"wrote {write_json('report_render.json', result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

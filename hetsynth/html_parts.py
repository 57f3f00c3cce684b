"""Pieces every page of `hetsynth report` draws with: the page style, the drawing sizes, tables.
(Written by hand for the reason in hetsynth.report_html.)"""

from __future__ import annotations

from html import escape
from typing import Any

WIDTH, ROW, LABEL = 1100, 18, 170
STYLE = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:8px 0;font-size:13px}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}td:first-child,th:first-child{text-align:left}
th{background:#f3f3f3}.note{color:#666;font-size:12px}.bad{color:#b00}
svg text{font-size:11px;font-family:system-ui,sans-serif}
"""


def table(header: list[str], rows: list[list[Any]], cls: str = "") -> str:
    head = "".join(f"<th>{escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><tr>{head}</tr>{body}</table>'


def ms(seconds: float | None) -> str:
    """Seconds as milliseconds with three decimals ("–" when unknown)."""
    return "–" if seconds is None else f"{seconds * 1e3:.3f} ms"

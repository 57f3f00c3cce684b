"""Render an HTML page in headless Chromium and read the screenshot's pixels (the report's
rendering check: tests/test_trace.py and bench/report_render.py).

The PNG is decoded here (zlib and the five PNG row filters, numpy) so that the check needs no
imaging library: Chromium writes 8-bit RGB(A), non-interlaced PNGs.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np

COMPUTE_RGB, COMMUNICATION_RGB = "3b7dd8", "e8862a"  # hetsynth.report_html's slice colours


def chromium() -> str | None:
    """The Chromium (or Chrome) binary on PATH, or None."""
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


def screenshot(page: Path, png: Path, *, width: int = 1200, height: int = 4000) -> None:
    binary = chromium()
    assert binary is not None, "no Chromium"
    subprocess.run([binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--screenshot={png}",
                    f"--window-size={width},{height}", page.resolve().as_uri()],
                   capture_output=True, timeout=120, check=True)


def _unfilter(raw: np.ndarray, height: int, bpp: int) -> np.ndarray:
    out = np.zeros((height, raw.shape[1] - 1), dtype=np.int32)
    for y in range(height):
        f, line = raw[y, 0], raw[y, 1:].astype(np.int32)
        up = out[y - 1] if y else np.zeros_like(line)
        if f in (0, 2):
            out[y] = (line + (up if f == 2 else 0)) % 256
            continue
        row = np.zeros_like(line)
        for x in range(len(line)):
            a = row[x - bpp] if x >= bpp else 0
            c = up[x - bpp] if x >= bpp else 0
            pred = {1: a, 3: (a + up[x]) // 2}.get(int(f))
            if pred is None:  # Paeth
                p = a + up[x] - c
                pa, pb, pc = abs(p - a), abs(p - up[x]), abs(p - c)
                pred = a if pa <= pb and pa <= pc else (up[x] if pb <= pc else c)
            row[x] = (line[x] + pred) % 256
        out[y] = row
    return out


def png_pixels(path: Path) -> np.ndarray:
    """(height, width, 3) RGB pixels of an 8-bit, non-interlaced PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    pos, chunks, header = 8, [], b""
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        header = body if kind == b"IHDR" else header
        chunks += [body] if kind == b"IDAT" else []
        pos += 12 + length
    width, height, depth, colour = struct.unpack(">IIBB", header[:10])
    assert depth == 8 and colour in (2, 6), f"PNG depth {depth}, colour type {colour}"
    bpp = 3 if colour == 2 else 4
    raw = np.frombuffer(zlib.decompress(b"".join(chunks)), dtype=np.uint8).reshape(height, width * bpp + 1)
    return _unfilter(raw, height, bpp).reshape(height, width, bpp)[:, :, :3]


def pixels_of(pixels: np.ndarray, colour: str) -> int:
    """How many pixels are (nearly) the colour 'rrggbb'."""
    rgb = np.array([int(colour[i:i + 2], 16) for i in (0, 2, 4)])
    return int((np.abs(pixels - rgb).sum(axis=2) < 12).sum())


def dark_pixels(pixels: np.ndarray) -> int:
    """Pixels of text and lines."""
    return int((pixels.sum(axis=2) < 200).sum())

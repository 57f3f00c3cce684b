"""A loss curve as a small self-contained SVG line plot (no plotting library needed).

    hetsynth launch plan.json examples/char_gpt.py train --steps 300 --losses losses.json
    python examples/plot_losses.py losses.json -o docs/char_gpt_loss.svg

The JSON holds {"losses": [...]} (one global loss per step) and optionally "ms_per_step",
"cluster", "size", "held_out_loss", which go into the title.
"""

import argparse
import json
import math
from pathlib import Path

WIDTH, HEIGHT, LEFT, RIGHT, TOP, BOTTOM = 640, 360, 56, 16, 40, 44


def ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values covering [low, high]."""
    raw = (high - low) / max(1, count - 1)
    step = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    step *= next((m for m in (1, 2, 5, 10) if m * step >= raw), 10)
    start = math.floor(low / step) * step
    values = (start + k * step for k in range(int((high - start) / step) + 2))
    return [v for v in values if low - 1e-9 <= v <= high + 1e-9]


def svg(losses: list[float], title: str) -> str:
    low, high = min(losses), max(losses)
    low, high = (low - 0.5, high + 0.5) if high == low else (low - 0.05 * (high - low), high + 0.05 * (high - low))
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    steps = max(1, len(losses) - 1)

    def x(i: float) -> float:
        return LEFT + plot_w * i / steps

    def y(v: float) -> float:
        return TOP + plot_h * (high - v) / (high - low)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">',
           f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
           f'<text x="{WIDTH / 2}" y="22" text-anchor="middle" font-size="14">{title}</text>']
    for v in ticks(low, high):
        out.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:g}</text>')
    for s in ticks(1, len(losses)):
        if s >= 1:
            out.append(f'<text x="{x(s - 1):.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle">{s:g}</text>')
    points = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(losses))
    out += [f'<polyline points="{points}" fill="none" stroke="#1f77b4" stroke-width="1.5"/>',
            f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#444"/>',
            f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 8}" text-anchor="middle">step</text>',
            f'<text transform="translate(14 {TOP + plot_h / 2}) rotate(-90)" text-anchor="middle">training loss</text>',
            "</svg>"]
    return "\n".join(out) + "\n"


def title(curve: dict) -> str:
    parts = [f"{curve.get('size', '')} char GPT".strip(), f"{len(curve['losses'])} steps"]
    if "cluster" in curve:
        parts.append(curve["cluster"])
    if "ms_per_step" in curve:
        parts.append(f"{curve['ms_per_step']:.0f} ms/step")
    parts.append(f"loss {curve['losses'][0]:.2f} to {curve['losses'][-1]:.2f}")
    return ", ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("losses", help="the JSON written by char_gpt.py train --losses")
    parser.add_argument("-o", "--output", default="loss.svg")
    args = parser.parse_args()
    curve = json.loads(Path(args.losses).read_text())
    if not curve.get("losses"):
        raise SystemExit(f"{args.losses}: no losses to plot")
    Path(args.output).write_text(svg(curve["losses"], title(curve)))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

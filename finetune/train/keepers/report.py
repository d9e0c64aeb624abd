"""RUN_DIR/report.html: the run on one page a browser opens without a network: the training loss and the
learning rate per step as inline SVG curves (held-out loss as points on the loss chart), the held-out figures,
memory per phase beside the plan (RUN_DIR/memory.json) and the recipe. Written from the run dir's own files,
like the summary, so it says what they say; no script, no external file.
"""
from __future__ import annotations

import html
import json
from pathlib import Path

from finetune.train.keepers.summary import measured_keys, read_records
from finetune.util import atomic

WIDTH, HEIGHT, PAD = 640, 240, 48
COLORS = {"loss": "#1f77b4", "eval_loss": "#d62728", "lr": "#2ca02c"}


def _scale(values: list[float], lo_px: float, hi_px: float):
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return lambda v: lo_px + (v - lo) / span * (hi_px - lo_px), lo, hi


def chart(title: str, series: dict[str, list[tuple[float, float]]]) -> str:
    """One SVG chart: each series a polyline (the first) or points (the rest), steps on x."""
    pts = [p for s in series.values() for p in s]
    if not pts:
        return f"<p>{html.escape(title)}: nothing logged.</p>"
    x, x0, x1 = _scale([p[0] for p in pts], PAD, WIDTH - 12)
    y, y0, y1 = _scale([p[1] for p in pts], HEIGHT - 28, 16)
    out = [f'<svg class="chart" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" '
           f'role="img" aria-label="{html.escape(title)}">',
           f'<rect x="{PAD}" y="16" width="{WIDTH - PAD - 12}" height="{HEIGHT - 44}" fill="none" stroke="#999"/>',
           f'<text x="{PAD}" y="12" font-size="12">{html.escape(title)}</text>',
           f'<text x="4" y="{HEIGHT - 28}" font-size="10">{y0:.4g}</text>',
           f'<text x="4" y="22" font-size="10">{y1:.4g}</text>',
           f'<text x="{PAD}" y="{HEIGHT - 8}" font-size="10">step {x0:g}</text>',
           f'<text x="{WIDTH - 80}" y="{HEIGHT - 8}" font-size="10">step {x1:g}</text>']
    for i, (name, s) in enumerate(series.items()):
        color = COLORS.get(name, "#555")
        if i == 0:
            coords = " ".join(f"{x(a):.1f},{y(b):.1f}" for a, b in s)
            out.append(f'<polyline class="{name}" fill="none" stroke="{color}" stroke-width="2" points="{coords}"/>')
        else:
            out += [f'<circle class="{name}" cx="{x(a):.1f}" cy="{y(b):.1f}" r="4" fill="{color}"/>' for a, b in s]
        out.append(f'<text x="{WIDTH - 140}" y="{30 + 14 * i}" font-size="11" fill="{color}">{name}</text>')
    return "\n".join(out + ["</svg>"])


def _memory_table(run_dir: Path) -> str:
    try:
        mem = json.loads((run_dir / "memory.json").read_text())
    except (OSError, ValueError):
        return "<p>No memory.json.</p>"
    keys = measured_keys(mem)
    phases: dict[str, dict] = {}
    for rank in mem.get("ranks", []):  # the largest rank's figure per phase
        for phase, v in rank.get("phases", {}).items():
            cur = phases.setdefault(phase, {})
            for k in keys:
                cur[k] = max(cur.get(k, 0), v.get(k) or 0)
    plan = mem.get("plan") or {}
    head = "".join(f"<th>{k.replace('_', ' ')} (GiB)</th>" for k in keys)
    rows = []
    for phase, v in phases.items():
        planned = plan.get(phase)
        cells = "".join(f"<td>{v[k] / 2**30:.2f}</td>" for k in keys)
        cells += f"<td>{planned / 2**30:.2f}</td>" if isinstance(planned, (int, float)) else "<td></td>"
        rows.append(f"<tr><td>{html.escape(phase)}</td>{cells}</tr>")
    return (f'<table class="memory"><tr><th>phase</th>{head}<th>plan (GiB)</th></tr>' + "".join(rows) + "</table>"
            + f"<p>{'RSS' if keys == ('peak_rss',) else 'GPU memory (torch)'} per process, largest rank.</p>")


def write_report(run_dir: Path) -> Path:
    records = read_records(run_dir)
    loss = [(r["step"], r["loss"]) for r in records if isinstance(r.get("loss"), (int, float))]
    lr = [(r["step"], r["lr"]) for r in records if isinstance(r.get("lr"), (int, float))]
    evals = [(r["step"], r["eval_loss"]) for r in records if isinstance(r.get("eval_loss"), (int, float))]
    held = {k: v for r in records for k, v in r.items() if k.startswith("eval_") and isinstance(v, (int, float))}
    recipe = run_dir / "recipe.yaml"
    recipe_text = recipe.read_text(errors="replace") if recipe.exists() else ""
    eval_rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{v:.4g}</td></tr>" for k, v in held.items())
    body = [f"<h1>finetune run: {html.escape(run_dir.name)}</h1>",
            f"<p>{len(loss)} logged steps; loss {loss[0][1]:.4g} at step {loss[0][0]} -> {loss[-1][1]:.4g} at step "
            f"{loss[-1][0]}.</p>" if loss else "<p>No step logged.</p>",
            "<h2>Loss</h2>", chart("training loss (line), held-out loss (points)", {"loss": loss, "eval_loss": evals}),
            "<h2>Learning rate</h2>", chart("learning rate", {"lr": lr}),
            "<h2>Held out</h2>", f'<table class="eval">{eval_rows}</table>' if held else "<p>No eval logged.</p>",
            "<h2>Memory per phase</h2>", _memory_table(run_dir),
            "<h2>Recipe</h2>", f"<pre>{html.escape(recipe_text)}</pre>"]
    page = ("<!doctype html>\n<html><head><meta charset='utf-8'><title>finetune report</title><style>"
            "body{font-family:sans-serif;margin:24px;max-width:760px} table{border-collapse:collapse}"
            "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right} pre{background:#f6f6f6;padding:8px}"
            "</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")
    out = run_dir / "report.html"
    atomic.write_text(out, page)  # no-follow temporary, then the rename: a planted link is never written through
    return out

"""The page of one GPU proof run (its out dir's RESULTS_GPU.md, from results.json: benchmarks/gpu/proof.py), and
the per-stage text that benchmarks/RESULTS_GPU.md (results_page.py) reuses. Figures are written as words and
numbers, never as Python literals, and scratch paths (run dirs, library files) are left out."""
from __future__ import annotations

from pathlib import PurePath

# keys of a stage's result that name a scratch file of the machine the proof ran on: not a figure
SCRATCH = ("run", "recipe", "predictions", "output_tail")


def _f(x, nd=2, pct=False):
    if x is None:
        return "n/a"
    if pct:
        return f"{100 * x:.1f}%"
    return f"{x:,.{nd}f}" if isinstance(x, float) else str(x)


def report(results: dict) -> str:
    m, st = results["meta"], results["stages"]
    env = (st.get("env") or {}).get("result") or {}
    title = "GPU proof (dry run on CPU: tiny shapes, no GPU figures)" if m["dry_run"] else "GPU proof"
    lines = [f"# {title}", "",
             f"`{m['command']}` on {m['date']}, commit `{m['commit']}`.", ""]
    if env:
        lines += [f"Device: {env.get('gpu', 'CPU')} ({env.get('nvidia_smi', 'no nvidia-smi')}); torch {env.get('torch')} "
                  f"(CUDA {env.get('cuda')}), transformers {env.get('transformers')}, accelerate {env.get('accelerate')}, "
                  f"peft {env.get('peft')}, bitsandbytes {env.get('bitsandbytes')}, trl {env.get('trl')}, "
                  f"datasets {env.get('datasets')}, pydantic {env.get('pydantic')}, Python {env.get('python')}.", ""]
    lines += ["| stage | status | seconds | what |", "|---|---|---|---|"]
    for name, r in st.items():
        lines.append(f"| {name} | {r['status']} | {r.get('seconds', '-')} | {r['what']} |")
    lines.append("")
    for name, r in st.items():
        lines += [f"## {name}", ""]
        if r["status"] != "ok":
            lines += [f"{r['status']}: {r.get('why') or ''}", "", "```", r.get("tail", ""), "```", ""]
            continue
        lines += _section(name, r["result"], results) + [""]
    return "\n".join(lines) + "\n"


def kv(x) -> str:
    """A result's dict or list as text: `a 1, b (c 2)`; errors in percent get their sign."""
    if isinstance(x, dict):
        parts = []
        for k, v in x.items():
            if k in SCRATCH:
                continue
            words = k.replace("_", " ")
            if isinstance(v, float) and k.startswith(("steps_", "load_")):  # errors_pct's keys
                parts.append(f"{words} {v:+.1f}%")
            else:
                parts.append(f"{words} ({kv(v)})" if isinstance(v, dict) else f"{words} {kv(v)}")
        return ", ".join(parts) or "none"
    if isinstance(x, list):
        return "[" + ", ".join(kv(v) for v in x) + "]"
    if isinstance(x, float):
        return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"
    return str(x)


def _site(frame: str) -> str:
    """A traced frame as the library's own path (transformers/models/...), not the proof machine's install dir."""
    frame = frame.replace(" [torch::unwind::unwind()]", "")
    for marker in ("site-packages/", "/site/"):
        if marker in frame:
            return frame.split(marker, 1)[1]
    return frame


def _mem_rows(memory: dict, plan: dict | None = None) -> list[str]:
    rows = []
    if memory["kind"] == "cuda":
        rows += ["| phase | peak allocated GiB | peak reserved GiB |", "|---|---|---|"]
        for ph, v in memory["phases"].items():
            rows.append(f"| {ph} | {v['peak_allocated_gib']:.2f} | {v['peak_reserved_gib']:.2f} |")
    else:
        rows += ["| phase | peak RSS GiB |", "|---|---|"]
        for ph, v in memory["phases"].items():
            rows.append(f"| {ph} | {v['peak_rss_gib']:.2f} |")
    return rows


def _run_rows(label: str, r: dict) -> list[str]:
    """One training run of the method stages: rate, loss, plan beside measured, eval, memory per phase."""
    p = r["plan"]
    out = [f"### {label}", "",
           f"- {_f(r['trained_tokens_per_s'], 0)} trained tokens/s ({r['s_per_step']} s/step over {r['timed_steps']} "
           f"timed steps); loss {r['first_loss']} -> {r['last_loss']}, finite: {r['losses_finite']}",
           f"- plan: peak allocated {p['allocated_gib']:.2f} GiB, reserved {p['reserved_gib']:.2f} GiB, loading "
           f"{p['loading_gib']:.2f} GiB; measured vs plan: {kv(r['errors_pct'])}"]
    if "eval" in r:
        out.append(f"- eval: {kv(r['eval'])}")
    return out + [""] + _mem_rows(r["memory"]) + [""]


def _env_rows(r: dict) -> list[str]:
    keys = ["transformers_ok", "bnb_library", "quantize_4bit_bytes_equal_cpu", "matmul_4bit_rel_err",
            "paged_adamw_8bit", "matmul_bf16_tflops", "copy_gb_s", "gpu_memory_gib", "capability"]
    # the library's file name only: the directory is the machine's scratch site-packages
    rows = [f"- {k}: {PurePath(r[k]).name if k == 'bnb_library' else kv(r[k])}" for k in keys if k in r]
    bad = {k: v for k, v in (r.get("floors") or {}).items() if not v["ok"]}
    rows.append(f"- pyproject floors not met here: {kv(bad)}")
    return rows


def _section(name: str, r: dict, results: dict) -> list[str]:
    if name == "env":
        return _env_rows(r)
    if name == "models":
        return [f"- {k}: `{v['name']}`, {v['gib']} GiB, built in {v['seconds']} s" for k, v in r.items()]
    if name.startswith(("single", "load70b")):
        out = [f"- trained tokens/s {_f(r['trained_tokens_per_s'], 0)} (all tokens/s {_f(r.get('all_tokens_per_s'), 0)}), "
               f"{r['s_per_step']} s/step over {r['timed_steps']} timed steps; loss {r['first_loss']} -> {r['last_loss']}"]
        if "mfu_vs_datasheet" in r:
            out.append(f"- MFU {_f(r['mfu_vs_datasheet'], pct=True)} of the datasheet bf16 peak, "
                       f"{_f(r['mfu_vs_measured_matmul'], pct=True)} of the measured matmul ceiling "
                       f"({r['flops_per_token']:.4g} model FLOPs per token)")
        p = r.get("plan", {})
        out.append(f"- plan (`finetune estimate`): peak allocated {p.get('allocated_gib', 0):.2f} GiB, reserved "
                   f"{p.get('reserved_gib', 0):.2f} GiB, loading {p.get('loading_gib', 0):.2f} GiB; measured vs plan: "
                   f"{kv(r.get('errors_pct') or {})}")
        return out + [""] + _mem_rows(r["memory"])
    if name.startswith("fsdp") and not name.startswith("fsdp2_trace"):
        out = [f"- train: loss {r['train']['first_loss']} -> {r['train']['last_loss']}, "
               f"{_f(r['train']['trained_tokens_per_s'], 0)} trained tokens/s",
               f"- resume: {kv(r['resume'])}", f"- eval: {kv(r['eval'])}", f"- generate: {kv(r['generate'])}"]
        if "plan" in r:
            out.append(f"- plan (`finetune estimate`): peak allocated {r['plan']['allocated_gib']:.2f} GiB, reserved "
                       f"{r['plan']['reserved_gib']:.2f} GiB; measured vs plan: {kv(r.get('errors_pct') or {})}")
        if "bytecheck" in r:
            out.append(f"- packed-byte check after the FSDP2 wrap and after unshard (bitsandbytes 1945): "
                       f"{kv(r['bytecheck'])}")
        return out + [""] + _mem_rows(r["train"]["memory"])
    if name.startswith("fsdp2_trace"):
        t = r["trace"]
        if isinstance(t, str):
            return [f"- {t}"] + [""] + _mem_rows(r["memory"])
        return ([f"- traced peak {t['peak_bytes_traced'] / 2**30:.2f} GiB over {t['entries']} allocator events; "
                 "alive at the peak:", "", "| GiB | allocated at |", "|---|---|"]
                + [f"| {x['gib']:.3f} | `{_site(x['site'])}` |" for x in t["sites"]] + [""] + _mem_rows(r["memory"]))
    if name.startswith("syncs"):
        out = []
        for run, v in r.items():
            if not isinstance(v, dict):
                out.append(f"- {run}: {kv(v)}")
                continue
            out.append(f"- {run}: {kv(v.get('syncs_by_step'))} host waits per optimizer step ({v['micro_batches_per_step']} "
                       f"micro-batches each; steady {v.get('steady_syncs_per_step')}); measurable: {v['measurable']}")
            out += [f"  - {n} x `{site}`" for site, n in v["in_steps_by_site"].items()]
        return out
    if name == "trl":
        return [f"- TRL: {kv(r['trl'])}", f"- finetune over TRL: {kv(r.get('finetune_over_trl') or {})}"]
    if name == "moe":
        return _run_rows("moe", r)
    if name in ("speed", "speed_unsloth"):
        return _speed_rows(r)
    if name in ("adapters", "preference", "long_context", "moe_speed"):
        out = []
        for run, v in r.items():
            out += _run_rows(run, v) if isinstance(v, dict) and "memory" in v else [f"- {run}: {kv(v)}"]
        return out
    return [f"- {k}: {kv(v)}" for k, v in r.items() if k not in SCRATCH]


def _speed_rows(r: dict) -> list[str]:
    """The speed stages: one row per arm (ours, then the peers), skipped arms with their reason."""
    if r.get("status") == "skipped":
        return [f"- skipped: {r['why']}"]
    arms = dict(r.get("arms") or {})
    for peer in ("trl", "unsloth"):
        if isinstance(r.get(peer), dict):
            arms[peer] = {"status": "ok", **r[peer], "trained_tokens_per_s": r[peer]["tokens_per_s"],
                          "steps_memory_gib": r[peer]}
    out = ["| arm | tokens/s | s/step | host s/step | steps peak allocated / reserved (GiB) or RSS | attention | "
           "loss first -> last | gradients | x TRL tokens/s |", "|---|---|---|---|---|---|---|---|---|"]
    ratios = r.get("over_trl") or {}
    for name, a in arms.items():
        if a["status"] != "ok":
            out.append(f"| {name} | {a['status']}: {a['why']} | | | | | | | |")
            continue
        m = a["steps_memory_gib"]
        mem = (f"{_f(m.get('peak_allocated_gib'))} / {_f(m.get('peak_reserved_gib'))}" if "peak_allocated_gib" in m
               else f"{_f(m.get('peak_rss_gib'))} RSS")
        losses, norms = a.get("losses") or [None], a.get("grad_norms") or []
        ok = a.get("gradients_ok", all(isinstance(g, float) and g > 0 for g in norms))
        out.append(f"| {name} | {_f(a['trained_tokens_per_s'], 0)} | {_f(a.get('s_per_step'), 3)} | "
                   f"{_f(a.get('host_s_per_step'), 4)} | {mem} | {a.get('attention')} | {_f(losses[0], 4)} -> "
                   f"{_f(losses[-1], 4)} | {'non-zero' if ok else 'ZERO or missing'} | "
                   f"{_f((ratios.get(name) or {}).get('tokens_per_s'), 3)} |")
    if r.get("over_unsloth"):
        out.append(f"- over unsloth: {kv(r['over_unsloth'])}")
    return out

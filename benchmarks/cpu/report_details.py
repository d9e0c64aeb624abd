"""RESULTS.md itself: the header and summary (report.py), then one section per row: what was measured, how,
when, and every sample behind each median."""
from __future__ import annotations

from benchmarks.cpu import report
from benchmarks.cpu.report import _f, status


def markdown(results: dict) -> str:
    parts = [report.header(results), "## Summary", "", report.summary_table(results), ""]
    parts += sections(results["rows"])
    return "\n".join(parts).rstrip() + "\n"


def _samples(xs, digits=4) -> str:
    return ", ".join(_f(float(x), digits) for x in xs)


def _guard(rows: dict, name: str, title: str, body) -> list[str]:
    st = status(rows.get(name))
    when = [f"Measured at {report.stamp(rows, name)}.", ""] if (rows.get(name) or {}).get("measured") else []
    if st == "ok":
        try:
            return [title, "", *when, *body(rows[name]), ""]
        except (KeyError, TypeError, ValueError) as e:  # a row whose result lacks a figure: say so, keep going
            return [title, "", f"Ran, but its result could not be shown ({type(e).__name__}: {e}).", ""]
    row = rows.get(name) or {}
    why = {"error": f"Failed: {row.get('error')}", "not available": f"Not available: {row.get('reason')}",
           "not run": "Not run this time (`--rows`)."}[st]
    text = [title, "", *when, why]
    if row.get("stderr"):
        text += ["", "```", row["stderr"], "```"]
    return text + [""]


def _precision(r: dict) -> str:
    if r.get("precision", "bf16") == "bf16":
        return "bf16 autocast"
    return ("fp32 compute on both sides (no autocast: this CPU has no native bf16 matmul, so finetune computes in "
            "fp32, and the plain loop is given the same)")


def throughput(r: dict) -> list[str]:
    return [
        f"finetune's loop (`finetune.train.loop.train` on recipes/tiny_cpu.yaml, throughput read from its "
        f"metrics.jsonl) against a plain transformers + peft + accelerate + bitsandbytes loop "
        f"(benchmarks/cpu/baseline.py) with the same 4-bit model, LoRA, tokenized data and order, micro-batch, "
        f"optimizer and {_precision(r)}. {r['reps']} fresh runs each, alternating; per run {r['warmup_steps']} "
        f"warm-up steps, then {r['timed_steps']} timed optimizer steps; {r.get('threads')} torch thread(s).",
        "",
        "| loop | trained tokens/s (median) | s per step (median) | samples (tokens/s) |", "|---|---|---|---|",
        f"| finetune | {_f(r['finetune_tokens_per_s'], 4)} | {_f(r['finetune_s_per_step'])} | "
        f"{_samples(r['samples']['finetune'])} |",
        f"| plain | {_f(r['plain_tokens_per_s'], 4)} | {_f(r['plain_s_per_step'])} | "
        f"{_samples(r['samples']['plain'])} |",
        *([f"| finetune, torch's SDPA kernel choice | "
           f"{_f(r['torch_kernels_ratio'] * r['plain_tokens_per_s'], 4)} | | "
           f"{_samples(r['samples']['finetune_torch_kernels'])} |"] if "torch_kernels_ratio" in r else []),
        "", f"Ratio of medians {_f(r['throughput_ratio'])}; ratio within each back-to-back pair: "
            f"{_samples(r['pair_ratios'], 3)}.",
        *(["", "Where the difference comes from: finetune's loop runs the output head and the fp32 loss on "
               "trained positions only (`train.loss.trained_rows_only`), and on CPU in bf16 picks SDPA's math "
               "kernel for batches of up to 128 tokens (`finetune.plan.attention`), where torch's default "
               "flash kernel has a slow backward. With torch's own kernel choice the ratio is "
               f"{_f(r['torch_kernels_ratio'])}."] if "torch_kernels_ratio" in r else []),
        "", "Same work on both sides: the first step's loss (LoRA B starts at zero, so it depends only on the "
            f"model and the batch) is {_f(r['first_loss']['finetune'], 7)} for finetune and "
            f"{_f(r['first_loss']['plain'], 7)} for the plain loop; they differ only by the rounding of the "
            + ("bf16 attention kernels." if r.get("precision", "bf16") == "bf16" else "fp32 sums, taken in another order.")]


def packing(r: dict) -> list[str]:
    keys = [k for k in r if k not in ("seconds",)]
    return ["From benchmarks/cpu/packing.py (real QLoRA steps on the tiny model, length-skewed examples).", "",
            "| figure | value |", "|---|---|", *[f"| {k} | {_f(r[k], 4)} |" for k in keys]]


def merge_rss(r: dict) -> list[str]:
    from benchmarks.cpu.merge_rss import table

    return ["Each merge in a fresh interpreter, which reports its own peak RSS (VmHWM). Growth is the extra "
            "peak RSS over the extra model bytes between the two sizes (benchmarks/cpu/merge_rss.py).", "",
            table(r)]


def estimate_error(r: dict) -> list[str]:
    lines = ["`finetune estimate`'s plan against bytes measured on the tiny NF4 + LoRA model "
             "(benchmarks/cpu/memcheck.py).", "", "| quantity | planned bytes | measured bytes | error |", "|---|---|---|---|"]
    lines += [f"| {x['what']} | {x['planned']:,} | {x['measured']:,} | {100 * x['error']:.2f}% |" for x in r["rows"]]
    return lines


def checkpointing(r: dict) -> list[str]:
    f = r["flops"]
    n, lo = f["off"]["N"], f["off"]["L"]
    ops = sorted(set(f["off"]["by_op_per_token"]) | set(f["on"]["by_op_per_token"]))
    return [
        f"Step time: finetune's loop on the tiny recipe with `model.gradient_checkpointing` off and on, "
        f"{r['reps']} fresh runs each, alternating. Median s/step: off {_f(r['s_per_step']['off'])}, "
        f"on {_f(r['s_per_step']['on'])} (x{_f(r['step_time_ratio'])}). Samples off: "
        f"{_samples(r['samples']['off'])}; on: {_samples(r['samples']['on'])}.", "",
        "FLOPs of one training step (forward + backward of finetune's loss), counted with "
        "`torch.utils.flop_counter.FlopCounterMode` on the recipe's micro-batch (every position trained), "
        "per token:", "",
        "| checkpointing | counted | rule | counted / rule | fuller model | counted / model | "
        + " | ".join(f"`{o}`" for o in ops) + " |",
        "|---|---|---|---|---|---|" + "---|" * len(ops),
        *[f"| {mode} | {_f(x['flops_per_token'], 4)} | {x['rule_name']} = {_f(float(x['rule']), 4)} | "
          f"{_f(x['vs_rule'])} | {_f(float(x['model']), 4)} | {_f(x['vs_model'])} | "
          + " | ".join(_f(x['by_op_per_token'].get(o, 0.0), 4) for o in ops) + " |"
          for mode, x in (("off", f["off"]), ("on", f["on"]))],
        "",
        f"Why 4N and 6N: N = {n:,} weights a token meets in matmuls (every decoder linear plus the head; the "
        "embedding is a lookup). Full fine-tuning costs 6N per token: forward 2N, backward 2N for input "
        "gradients and 2N for weight gradients. LoRA freezes the base, so the backward computes no weight "
        "gradient for it: 2N + 2N = **4N**. Activation checkpointing reruns each decoder layer's forward "
        "during backward: another 2N, so **6N** (a little under, as the head is not recomputed).",
        "",
        f"Why the counts sit above the rules: the rules leave out the adapters and attention. The LoRA "
        f"adapters (L = {lo:,} parameters, r = 16 on every linear: large next to a 256-wide model) cost 6L "
        "per token (forward 2L, input and weight gradients 4L), plus 2L when recomputed; attention scores "
        "cost 4 x seq x heads x head_dim per layer forward and twice that backward (a forward more when "
        "recomputed). The fuller model adds these. Without checkpointing it still overshoots slightly: the "
        "first layer's q/k/v read the frozen embedding, whose output needs no gradient, so autograd skips "
        "those input-gradient matmuls; with checkpointing enabled transformers makes that input require "
        "grad, and they run.",
        "",
        "How it was counted: bitsandbytes' 4-bit matmul is a custom op (`bitsandbytes::gemm_4bit`) that "
        "FlopCounterMode cannot look inside, so the benchmark registers a formula for it (2 x rows x out x "
        "in); the backward dequantizes and uses an ordinary `mm`, counted as such. Attention runs `eager` for "
        "the count (the counter has no formula for the CPU SDPA kernel; eager computes the same full score "
        "matrix as `bmm`). Step times above use the recipe's SDPA.",
        "",
        f"Counted FLOPs rise by x{_f(r['flops_ratio'])} with checkpointing; step time by "
        f"x{_f(r['step_time_ratio'])}. On a model this small a step's time is not proportional to its FLOPs "
        "(per-op costs such as Python dispatch and 4-bit dequantization weigh as much as the arithmetic), so "
        "the two ratios need not agree; on a GPU-sized model step time follows the FLOPs more closely."]


def startup(r: dict) -> list[str]:
    s = r["samples"]
    return ["Time to first step: `python -m finetune recipes/tiny_cpu.yaml` from launch to its `step=1` line "
            "(imports, preflight, tokenizer, data, 4-bit model, LoRA, first optimizer step; builtin assets "
            "already built). `validate`: wall time of `python -m finetune validate "
            "recipes/llama3_70b_qlora.yaml` (no weights, plans from the architecture table).", "",
            "| command | median | samples (s) |", "|---|---|---|",
            f"| first step, tiny recipe | {_f(r['first_step_s'])} s | {_samples(s['first_step_s'], 3)} |",
            f"| validate, 70B recipe | {_f(r['validate_70b_s'])} s | {_samples(s['validate_70b_s'], 3)} |"]


def trl_sft(r: dict) -> list[str]:
    from benchmarks.peers.trl_compare import section

    return section(r)


def loss_memory(r: dict) -> list[str]:
    c, f = r["chunked"], r["full"]
    mib = 2**20
    return [f"Peak bytes of the loss path (output head + cross-entropy, forward and backward) at {r['tokens']} "
            f"trained tokens with a {r['vocab']:,}-token vocabulary, precision `{r['precision']}`, on CPU: "
            "finetune's chunked loss (train.loss) against full logits, each in a fresh process, measured as "
            "the growth of its peak resident set (benchmarks/cpu/loss_memory.py), beside the planner's figure "
            "(finetune/plan/logits.py).", "",
            "| loss | measured | planned | plan error |", "|---|---|---|---|",
            f"| chunked | {_f(c['measured_bytes'] / mib, 4)} MiB | {_f(c['planned_bytes'] / mib, 4)} MiB | "
            f"{_f(100 * c['plan_error'], 2)}% |",
            f"| full logits | {_f(f['measured_bytes'] / mib, 4)} MiB | {_f(f['planned_bytes'] / mib, 4)} MiB | "
            f"{_f(100 * f['plan_error'], 2)}% |", "",
            f"Full / chunked: **{_f(r['loss_memory_ratio'])}x**; same loss: {r['same_loss']}."]


def load_rss(r: dict) -> list[str]:
    from benchmarks.cpu.load_rss import table

    return ["Fresh processes (torchrun for 2, gloo) load the synthetic model through the streaming loader, "
            "attach LoRA and `prepare` (benchmarks/cpu/load_rss.py); each reports its peak RSS (VmHWM) over its "
            "RSS after importing every library. `planned` is the planner's load phase for the reader.", "",
            table(r)]


def phase_rss(r: dict) -> list[str]:
    from benchmarks.cpu.phase_rss import table

    return ["A whole run per phase (benchmarks/cpu/phase_rss.py): the shipped CPU recipes on a synthetic bf16 Llama "
            "(2 steps, micro-batch 2, the end-of-run eval), one process against 2 FSDP ranks over gloo; growth is "
            "each phase's peak RSS over the RSS when the run began (memory.json), plan is the planner's CPU RAM "
            "per process for the phases it plans.", "", table(r)]


def prepare_rss(r: dict) -> list[str]:
    from benchmarks.cpu.prepare_rss import table

    return ["`finetune data` on N tiny alpaca-like rows (benchmarks/cpu/prepare_rss.py, `--rows N` to run it alone), in "
            "a fresh process on a cold cache, then again on the warm cache; peak RSS is the process's VmHWM. "
            "The bound held by docs/robustness.md: 2,000,000 rows under 1.5 GiB.", "", table(r)]


def moe_speedup(r: dict) -> list[str]:
    # the model as the row measured it (a kept row from an older run names its own)
    m = dict(kv.split("=") for kv in r.get("model", "?").partition("?")[2].split("&") if "=" in kv)
    shape = (f"{m.get('layers', '?')} layers, {m.get('experts', '?')} experts, top-{m.get('experts_per_tok', '?')}, "
             f"hidden {m.get('hidden', '?')}, expert intermediate {m.get('moe_intermediate', '?')}")
    compute = " in fp32" if r.get("compute") == "fp32" else ""
    return [f"The real loop on a synthetic Qwen3-MoE ({shape}; 4-bit experts, LoRA on them and on attention){compute}, "
            "grouped experts against the per-expert loop (FINETUNE_MOE_EXPERTS=per_expert), runs alternating in "
            "fresh processes (benchmarks/cpu/moe_speedup.py, whose docstring says why this model).", "",
            "| path | trained tokens/s | peak RSS MiB |", "|---|---|---|",
            f"| grouped | {_f(r['grouped_tokens_per_s'])} | {_f(r['grouped_peak_rss_mib'])} |",
            f"| per-expert | {_f(r['per_expert_tokens_per_s'])} | {_f(r['per_expert_peak_rss_mib'])} |"]


SECTIONS = [("throughput", "## 1. Training loop throughput", throughput),
            ("packing", "## 2. Packing", packing),
            ("merge_rss", "## 3. Merge memory", merge_rss),
            ("estimate_error", "## 4. Memory planner against measurement", estimate_error),
            ("checkpointing", "## 5. Gradient checkpointing", checkpointing),
            ("startup", "## 6. Startup", startup),
            ("trl_sft", "## 7. Against TRL's SFTTrainer", trl_sft),
            ("loss_memory", "## 8. Loss memory", loss_memory),
            ("load_rss", "## 9. Loading memory", load_rss),
            ("phase_rss", "## 10. Memory per phase of a whole run", phase_rss),
            ("prepare_rss", "## 11. Data preparation memory", prepare_rss),
            ("moe_speedup", "## 12. MoE experts, grouped", moe_speedup)]


def sections(rows: dict) -> list[str]:
    out = []
    for name, title, body in SECTIONS:
        out += _guard(rows, name, title, body)
    return out

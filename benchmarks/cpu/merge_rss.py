"""Peak RSS of `finetune merge` against peft's `merge_and_unload`, as the model grows.

Two synthetic bf16 Llama models (~200 MB and ~400 MB, written in 100 MB shards, each with an all-linear
r=16 LoRA adapter) are merged by each tool in a fresh subprocess, three times each (median); the child
reports its own peak RSS (VmHWM from /proc/self/status). Growth = extra peak RSS / extra model bytes: a streaming
merge should stay well under 0.25 (it holds about one input and one output shard, whatever the model),
while loading the whole model to merge it grows by about 1.

    python -m benchmarks.cpu.merge_rss          # prints the table; run() returns the figures
"""
from __future__ import annotations

import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHARD = 100 * 10**6
HIDDEN, INTER, VOCAB, HEADS, KV_HEADS = 1024, 2816, 8192, 16, 8
LAYERS = {"small": 7, "large": 16}  # ~197 MB and ~406 MB in bf16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _shapes(n_layers: int) -> list[tuple[str, tuple[int, ...]]]:
    kv = HIDDEN // HEADS * KV_HEADS
    out = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(n_layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (HIDDEN,)), (p + "post_attention_layernorm.weight", (HIDDEN,)),
                (p + "self_attn.q_proj.weight", (HIDDEN, HIDDEN)), (p + "self_attn.k_proj.weight", (kv, HIDDEN)),
                (p + "self_attn.v_proj.weight", (kv, HIDDEN)), (p + "self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
                (p + "mlp.gate_proj.weight", (INTER, HIDDEN)), (p + "mlp.up_proj.weight", (INTER, HIDDEN)),
                (p + "mlp.down_proj.weight", (HIDDEN, INTER))]
    return out + [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]


def build(root: Path, n_layers: int) -> tuple[Path, int]:
    """A base dir (bf16 shards of <= 100 MB, index, config, tokenizer) and a PEFT adapter dir beside it.
    Written one shard at a time, so building does not hold the model either. Returns (adapter dir, bytes)."""
    import torch
    from peft import LoraConfig
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig

    from finetune.util import builtin as tiny

    base, adapter = root / "base", root / "adapter"
    base.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    shards, cur, size, total = [], {}, 0, 0
    for name, shape in _shapes(n_layers):
        n = math.prod(shape) * 2
        if cur and size + n > SHARD:
            shards.append(cur)
            save_file(cur, str(base / f"part-{len(shards):03d}.safetensors"), metadata={"format": "pt"})
            cur, size = {}, 0
        cur[name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        size, total = size + n, total + n
    shards.append(cur)
    save_file(cur, str(base / f"part-{len(shards):03d}.safetensors"), metadata={"format": "pt"})
    # Real HF names are model-0000i-of-0000n; these differ on purpose: the merge must follow the index.
    weight_map = {k: f"part-{i + 1:03d}.safetensors" for i, s in enumerate(shards) for k in s}
    (base / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=n_layers,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, tie_word_embeddings=False,
                dtype="bfloat16").save_pretrained(base)
    AutoTokenizer.from_pretrained(tiny.model_dir()).save_pretrained(base)
    del shards, cur
    lora = {}
    for name, shape in _shapes(n_layers):
        if name.split(".")[-2] in TARGETS:
            mod = "base_model.model." + name.removesuffix(".weight")
            lora[mod + ".lora_A.weight"] = torch.randn((16, shape[1]), generator=gen) * 0.01
            lora[mod + ".lora_B.weight"] = torch.randn((shape[0], 16), generator=gen) * 0.01
    adapter.mkdir()
    save_file(lora, str(adapter / "adapter_model.safetensors"), metadata={"format": "pt"})
    LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, task_type="CAUSAL_LM",
               base_model_name_or_path=str(base)).save_pretrained(adapter)
    return adapter, total


def _child(tool: str, adapter: str, out: str) -> None:
    """Runs in a fresh interpreter; prints its own peak RSS in bytes."""
    if tool == "finetune":
        from finetune.merge.stream import merge

        merge(adapter, output=out, dtype="bf16", max_shard_size="100MB", check=False)
    else:
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        cfg = json.loads((Path(adapter) / "adapter_config.json").read_text())
        model = AutoModelForCausalLM.from_pretrained(cfg["base_model_name_or_path"], dtype=torch.bfloat16)
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
        model.save_pretrained(out, max_shard_size="100MB")
    print(json.dumps({"peak_rss": peak_rss()}))


def peak_rss() -> int:
    """This process's peak RSS in bytes. VmHWM, not getrusage: Linux carries ru_maxrss across fork and
    exec, so a child started by a big parent would report the parent's peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def _measure(tool: str, adapter: Path, out: Path) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.cpu.merge_rss", "--child", tool, str(adapter), str(out)],
                          capture_output=True, text=True, env=env, cwd=root, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{tool} merge failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_rss"]


def run(reps: int = 3) -> dict:
    """Each tool merges each model `reps` times, alternating tools; growth is computed from the medians."""
    import statistics

    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="merge-rss-") as tmp:
        sizes, samples = {}, {"finetune": {}, "peft": {}}
        for label, layers in LAYERS.items():
            adapter, sizes[label] = build(Path(tmp) / label, layers)
            for i in range(reps):
                for tool in (samples if i % 2 == 0 else list(samples)[::-1]):
                    out = Path(tmp) / label / f"out-{tool}-{i}"
                    samples[tool].setdefault(label, []).append(_measure(tool, adapter, out))
                    shutil.rmtree(out, ignore_errors=True)  # keep the disk footprint at one model per tool
    peaks = {tool: {label: int(statistics.median(v)) for label, v in by.items()} for tool, by in samples.items()}
    extra = sizes["large"] - sizes["small"]
    growth = {tool: (p["large"] - p["small"]) / extra for tool, p in peaks.items()}
    return {"merge_rss_growth": growth["finetune"], "peft_rss_growth": growth["peft"],
            "model_bytes": sizes, "peak_rss_bytes": peaks, "samples": samples, "reps": reps,
            "shard_bytes": SHARD, "seconds": round(time.time() - t0, 1)}


def table(res: dict) -> str:
    mb = 1e6
    rows = ["| tool | peak RSS, ~200 MB model | peak RSS, ~400 MB model | growth per extra model byte |",
            "|---|---|---|---|"]
    for tool, key in (("finetune merge (streaming)", "finetune"), ("peft merge_and_unload", "peft")):
        p = res["peak_rss_bytes"][key]
        g = res["merge_rss_growth"] if key == "finetune" else res["peft_rss_growth"]
        rows.append(f"| {tool} | {p['small'] / mb:.0f} MB | {p['large'] / mb:.0f} MB | {g:.3f} |")
    s = res["model_bytes"]
    text = "\n".join(rows) + f"\n\nModels: {s['small'] / mb:.0f} MB and {s['large'] / mb:.0f} MB bf16, 100 MB shards."
    if "samples" in res:
        runs = "; ".join(f"{tool} {label}: {', '.join(f'{x / mb:.0f}' for x in xs)} MB"
                         for tool, by in res["samples"].items() for label, xs in by.items())
        text += f" Peak RSS is the median of {res['reps']} merges each ({runs})."
    return text


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(*sys.argv[2:5])
    else:
        print(table(run()))

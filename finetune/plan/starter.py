"""A first recipe for a model and a data file (`finetune init`): the sizes chosen from what the data measured
and the memory plan (estimate.build), and the recipe's text with a comment on every choice. Pure: the caller
measures the data with the model's tokenizer and passes the figures in."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace

import yaml

from finetune.plan import estimate as E
from finetune.plan.headers import BEGIN, END
from finetune.recipe import from_dict

TARGET_BATCH = 16  # sequences per optimizer step: a common starting point for LoRA fine-tuning
MICRO_BATCHES = (16, 8, 4, 2, 1)
PLAIN = ("instruction", "prompt_completion")  # rows that train through the chat template with prompt_template: chat


@dataclass
class DataFacts:
    path: str
    format: str
    fields: list[str]
    rows: int
    longest: int  # tokens of the longest example, as training renders it
    p99: int  # tokens within which 99% of the examples fit
    chat: bool  # rows that render with a chat template


@dataclass
class ModelFacts:
    name: str
    architecture: str
    max_positions: int | None
    dtype: str  # the checkpoint's own dtype (frozen weights keep it)
    chat_template: bool


@dataclass
class Sizing:
    device: str  # "cuda" or "cpu"
    gpus: int
    gpu_memory: int | None
    max_seq_len: int
    micro_batch: int
    accumulation: int
    strategy: str
    offload: bool
    eval_split: float
    epochs: float
    planned: int  # bytes per device the plan gives
    notes: list[str] = field(default_factory=list)


def scalar(value: str) -> str:
    """`value` as one YAML scalar, by the YAML library: a '#', a line break or a leading '-' stays part of the
    value (a data file named `exp #3.jsonl` used to become `exp`; a line break injected recipe keys)."""
    text = yaml.safe_dump(value, default_style='"', width=1 << 30, allow_unicode=True).strip()
    return text.removesuffix("\n...").strip()


def comment(value) -> str:
    """`value` inside a `# ...` comment line: control characters escaped, so it cannot end the comment."""
    return json.dumps(str(value), ensure_ascii=False)[1:-1]


def seq_len(data: DataFacts, model: ModelFacts) -> int:
    """The 99th percentile rounded up to 64 tokens, within the model's context."""
    n = max(64, math.ceil(data.p99 / 64) * 64)
    return min(n, model.max_positions) if model.max_positions else n


def held_out(rows: int) -> float:
    """About 5% of the rows, at least 10 and at most 500 (enough for a steady eval_loss, not more)."""
    if rows < 20:
        return 0.0
    return round(min(max(10, round(0.05 * rows)), 500) / rows, 4)


def learning_rate(data: DataFacts, gpu: bool) -> float:
    """LoRA's usual start; a tenth of it for DPO, whose pairs move the policy away from a reference."""
    return (2.0e-4 if gpu else 2.0e-3) / (10 if data.format == "preference" else 1)


def base_recipe(data: DataFacts, model: ModelFacts, device: str, gpus: int) -> dict:
    gpu = device == "cuda"
    return {"model": {"name": model.name, **({"dtype": model.dtype} if gpu else {}),
                      "gradient_checkpointing": gpu},
            "quantization": {"mode": "nf4"},
            "lora": {"r": 16, "alpha": 32, "dropout": 0.05 if gpu else 0.0},
            "data": {"sources": [{"path": data.path, "format": data.format}], "max_seq_len": 64,
                     **({"prompt_template": "chat"} if data.format in PLAIN and model.chat_template else {}),
                     **({} if model.chat_template or not data.chat else {"chat_template": "chatml"})},
            "train": {"micro_batch_size": 1, "learning_rate": learning_rate(data, gpu),
                      **({"method": "dpo"} if data.format == "preference" else {})},
            "distributed": {"strategy": "fsdp" if gpus > 1 else "single", "num_processes": gpus}}


def size(data: DataFacts, model: ModelFacts, device: str, gpus: int, gpu_memory: int | None) -> Sizing:
    """The largest micro-batch (up to TARGET_BATCH) the plan fits at the measured length, then accumulation to
    about TARGET_BATCH sequences per step; FSDP for several GPUs, CPU offload only when nothing else fits."""
    n = seq_len(data, model)
    recipe = from_dict(base_recipe(data, model, device, gpus))
    setup = replace(E.from_recipe(recipe), seq_len=n, device=device, gpus=gpus,
                    gpu_memory=gpu_memory if device == "cuda" else None)
    notes, chosen = [], None
    for offload in (False, True):
        for micro in MICRO_BATCHES:
            s = replace(setup, micro_batch=micro, offload=offload, strategy="fsdp" if offload or gpus > 1 else "single")
            plan = E.build(s)
            if plan.fits() is not False:
                chosen = (s, plan)
                break
        if chosen:
            break
    if chosen is None:
        s = replace(setup, micro_batch=1, offload=True, strategy="fsdp")
        chosen = (s, E.build(s))
        notes.append(f"the plan does not fit {gpus} GPU(s) of this size even at micro-batch 1 with CPU offload: "
                     "use more or larger GPUs, or a shorter data.max_seq_len")
    elif chosen[0].offload:
        notes.append("fsdp.cpu_offload: the model does not fit these GPUs otherwise; steps run slower")
    s, plan = chosen
    if device == "cuda" and data.longest > n:
        notes.append(longer_rows(data, model, setup, n))
    rows = max(1, round(data.rows * (1 - held_out(data.rows))))
    accumulation = max(1, min(TARGET_BATCH // (s.micro_batch * gpus), math.ceil(rows / (s.micro_batch * gpus * 8))))
    epochs = 3.0 if data.rows < 1000 else 2.0 if data.rows < 10000 else 1.0
    return Sizing(device, gpus, s.gpu_memory, n, s.micro_batch, accumulation, s.strategy, s.offload,
                  held_out(data.rows), epochs, plan.gpu_bytes_per_device, notes)


def longer_rows(data: DataFacts, model: ModelFacts, setup: E.Setup, n: int) -> str:
    """For data whose longest rows pass data.max_seq_len: the longest length these GPUs fit at micro-batch 1
    (finetune.plan.longest, as `estimate --max-seq-len` answers), as written and with both long-context knobs."""
    from finetune.plan.longest import longest

    cap = model.max_positions or 10**9
    plain = min(cap, longest(setup))
    both = min(cap, longest(replace(setup, activation_offload=True, tiled_mlp=True)))
    return (f"your longest example has {data.longest} tokens and data.max_seq_len is {n} (99% of the rows): at "
            f"micro-batch 1 these GPUs fit data.max_seq_len up to {plain}, or {both} with "
            "model.activation_offloading: true and model.tiled_mlp: true (`finetune estimate RECIPE --max-seq-len`)")


def recipe_text(data: DataFacts, model: ModelFacts, z: Sizing, out_dir: str) -> str:
    """The recipe, commented; the plan block between BEGIN and END is filled by headers.rewrite."""
    gpu = z.device == "cuda"
    size_txt = f"{z.gpu_memory / 2**30:g}GiB" if gpu and z.gpu_memory else "cpu"
    held = (f"{z.eval_split:g} of your rows ({round(z.eval_split * data.rows)}) are held out, never trained"
            if z.eval_split else "too few rows to hold any out: eval_loss is not measured")
    template = ("its own chat template" if model.chat_template else
                "no chat template of its own: ChatML (data.chat_template)" if data.chat else "no chat template")
    # Every value the user or their files chose goes in through `scalar`, every comment through `comment`.
    lines = [f"# Written by `finetune init --model {comment(model.name)} --data {comment(data.path)}`: a first run "
             "to adjust.",
             f"# data:  {data.rows} rows of {data.format} ({comment(', '.join(data.fields))}); the longest example "
             f"has {data.longest} tokens, 99% fit in {data.p99}",
             f"# model: {comment(model.architecture)}, {template}",
             *[f"# note:  {comment(n)}" for n in z.notes],
             BEGIN, f"# planned for: {z.gpus} x {size_txt}", END,
             "model:",
             f"  name: {scalar(model.name)}"]
    if gpu:
        lines.append(f"  dtype: {model.dtype}            # the checkpoint's own dtype for the frozen weights")
    lines += [f"  gradient_checkpointing: {str(gpu).lower()}   # recompute activations: "
              + ("memory for time" if gpu else "off on CPU, where the tiny activations cost little"),
              "quantization:",
              "  mode: nf4                  # QLoRA: the frozen base in 4 bits",
              "lora:",
              "  r: 16",
              "  alpha: 32",
              f"  dropout: {0.05 if gpu else 0.0}",
              "data:",
              "  sources:",
              f"    - path: {scalar(data.path)}",
              f"      format: {data.format}   # detected from the fields",
              f"  eval_split: {z.eval_split}   # {held}",
              f"  max_seq_len: {z.max_seq_len}   # 99% of the examples fit whole; longer ones are truncated"]
    if data.format in PLAIN and model.chat_template:
        lines.append("  prompt_template: chat   # the prompt as the user turn, through the model's chat template, as a "
                     "chat server sends it (raw: the plain text layout)")
    if data.chat and not model.chat_template:
        lines.append("  chat_template: chatml   # the tokenizer has none; ChatML renders the chats")
    lines += ["train:",
              f"  micro_batch_size: {z.micro_batch}   # the largest the memory plan fits (up to {TARGET_BATCH})",
              f"  gradient_accumulation_steps: {z.accumulation}   # about {TARGET_BATCH} sequences per step "
              "(fewer for a small data set, so it still takes steps)",
              f"  epochs: {z.epochs:g}   # passes over the training rows",
              f"  learning_rate: {learning_rate(data, gpu):g}",
              "  warmup_steps: 10"]
    if data.format == "preference":
        lines.append("  method: dpo   # the rows are preference pairs (prompt, chosen, rejected): DPO learns from "
                     "them (orpo: the other choice, without a reference)")
    if z.gpus > 1 or z.offload:
        lines += ["distributed:", f"  strategy: {z.strategy}", f"  num_processes: {z.gpus}"]
    if z.offload:
        lines += ["fsdp:", "  cpu_offload: true   # nothing else fits these GPUs"]
    lines += ["output:", f"  dir: {scalar(out_dir)}"]
    return "\n".join(lines) + "\n"

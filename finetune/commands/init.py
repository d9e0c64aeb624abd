"""`finetune init --model ID_OR_DIR --data FILE [--gpus N --gpu-memory 24GiB] [-o RECIPE]`: a first recipe
for your own model and data. It reads the data (format, fields, rows), measures every example's tokens with
the model's tokenizer as training renders it, reads the model's config (architecture, context, dtype) and
chat template, sizes micro-batch, accumulation, max_seq_len and FSDP with the memory plan, holds out a
share of your own rows for eval, and writes a commented recipe that it then validates."""
from __future__ import annotations

import os
from pathlib import Path

import yaml

from finetune.commands.common import GPUS_MAX, count
from finetune.util.errors import RecipeError

MEASURE_CAP = 32768  # tokens: examples are measured up to this length (longer ones count as this long)


def register(sub) -> None:
    p = sub.add_parser("init", help="write a first recipe for a model and a data file",
                       description="Inspect a data file and a model, size the run with the memory plan and write a "
                                   "commented recipe that validates.")
    p.add_argument("--model", required=True, help="hub id (in the local cache), local directory or builtin:tiny-llama")
    p.add_argument("--data", required=True, help="data file or folder (jsonl, json, csv, parquet, save_to_disk)")
    p.add_argument("--gpus", type=count(1, GPUS_MAX), help="plan a GPU run on N GPUs (default: a CPU run unless --gpu-memory)")
    p.add_argument("--gpu-memory", help="memory of one GPU, e.g. 24GiB (default 24GiB for a GPU run)")
    p.add_argument("-o", "--output", type=Path, help="recipe to write (default: DATA's name with .yaml, here)")
    p.add_argument("--run-dir", help="the recipe's output.dir (default runs/<recipe name>)")
    p.add_argument("--force", action="store_true", help="replace an existing recipe file")
    p.set_defaults(run=run)


def model_facts(name: str, tok):
    from finetune.plan.archs import find_config
    from finetune.plan.starter import ModelFacts

    cfg, where = find_config(name)
    if cfg is None:
        raise RecipeError([f"--model: no config.json for '{name}' ({where}); give a local directory, or fetch the "
                           f"model once where there is network: hf download {name}"])
    text = cfg.get("text_config") or cfg
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or text.get("dtype") or "bfloat16"
    return ModelFacts(name=name, architecture=(cfg.get("architectures") or [cfg.get("model_type", "?")])[0],
                      max_positions=text.get("max_position_embeddings"),
                      dtype="float32" if dtype == "float32" else "bfloat16",
                      chat_template=bool(getattr(tok, "chat_template", None)))


def data_facts(path: str, tok, model) -> object:
    """Rows, format and fields of the file, and every example's length as training tokenizes it."""
    from finetune.data.formats import BadRows, detect_format
    from finetune.data.prepare import prepare
    from finetune.data.sources import iter_rows
    from finetune.plan.archs import vocab_size
    from finetune.plan.starter import DataFacts
    from finetune.recipe import DataSource, DataSpec

    first = next(iter_rows(DataSource(path=path), BadRows("skip")), None)
    if first is None:
        raise RecipeError([f"--data: {path}: no rows"])
    plain = detect_format(first) in ("instruction", "prompt_completion") and isinstance(first.get("prompt", ""), str)
    spec = DataSpec(sources=[DataSource(path=path)], eval_split=0, on_bad_row="skip",
                    max_seq_len=min(model.max_positions or MEASURE_CAP, MEASURE_CAP),
                    chat_template=None if model.chat_template else "chatml",
                    prompt_template="chat" if plain and model.chat_template else "raw")  # measured as written
    stats = prepare(spec, tok, vocab_size(model.name)).stats
    src = stats["sources"][0]
    chat = src["format"] in ("messages", "sharegpt") or isinstance(first.get("prompt"), list)
    facts = DataFacts(path=path, format=src["format"], fields=sorted(k for k in first if k != "_where"),
                      rows=src["rows_read"], longest=stats["longest_example"], p99=stats["max_seq_len_99pct"],
                      chat=chat)
    return facts, stats


def refuse_output(out: Path, force: bool) -> None:
    """-o: never through a symbolic link (other writers refuse links too), never a name with a control
    character (it lands in the recipe's launch comment), never an existing file without --force."""
    if out.is_symlink():
        raise RecipeError([f"-o: {out} is a symbolic link (to {os.readlink(out)}); init does not write through "
                           "links: name the file itself"])
    if any(ord(c) < 32 or ord(c) == 127 for c in str(out)):
        raise RecipeError([f"-o: {str(out)!r} holds a control character; choose a recipe name without one"])
    if out.exists() and not force:
        raise RecipeError([f"-o: {out} exists; choose another path or add --force to replace it"])


def write_validated(out: Path, text: str, given: dict, device: str) -> str:
    """Write the recipe to a hidden sibling, fill its plan block, validate the file as read back (schema,
    contract, and the model, data path and run dir equal to what was given: nothing injected, nothing cut at a
    '#'), then rename it to `out`. On any failure the sibling is removed and `out` is untouched. Returns the
    launch command."""
    from finetune.plan.headers import launch_command, rewrite
    from finetune.recipe import load
    from finetune.util import atomic

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.init-tmp")
    try:
        atomic.write_bytes(tmp, text.encode())
        rewrite(tmp)  # the plan block: launch command and memory, as every shipped recipe has
        recipe = load(tmp)  # schema and FSDP/QLoRA contract: a recipe init writes always validates
        raw = yaml.safe_load(tmp.read_text())
        back = {"model": recipe.model.name, "data": raw["data"]["sources"][0]["path"], "run_dir": raw["output"]["dir"]}
        if back != given:
            raise RecipeError([f"-o: {out} would not say what was given (read back: {back!r}, given: {given!r}); "
                               "nothing was written"])
        launch = launch_command(recipe, str(out), device, Path(__file__).resolve().parents[2])
        # the header names recipes by recipes/NAME (where shipped ones live); this one is where it was written
        atomic.write_bytes(tmp, ("\n".join(f"# launch:      {launch}" if line.startswith("# launch:") else line
                                           for line in tmp.read_text().splitlines()) + "\n").encode())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return launch


def run(a) -> int:
    from finetune.commands.common import at_least_one
    from finetune.commands.data import tokenizer_for
    from finetune.plan.starter import recipe_text, size
    from finetune.recipe import ModelSpec
    from finetune.util.units import fmt, parse_size

    at_least_one(a, "gpus")
    out = a.output or Path(Path(a.data).stem + ".yaml")
    refuse_output(out, a.force)
    device = "cuda" if a.gpus or a.gpu_memory else "cpu"
    gpus, memory = a.gpus or 1, parse_size(a.gpu_memory or "24GiB", "--gpu-memory") if device == "cuda" else None
    tok = tokenizer_for(ModelSpec(name=a.model))
    model = model_facts(a.model, tok)
    data, stats = data_facts(a.data, tok, model)
    z = size(data, model, device, gpus, memory)
    launch = write_validated(out, recipe_text(data, model, z, a.run_dir or f"runs/{out.stem}"),
                             {"model": model.name, "data": data.path, "run_dir": a.run_dir or f"runs/{out.stem}"},
                             device)
    bad = f"; {stats['rows_skipped']} bad rows skipped (see `finetune data`)" if stats["rows_skipped"] else ""
    print(f"data: {data.path}: {data.rows} rows of {data.format} ({', '.join(data.fields)}){bad}; longest example "
          f"{data.longest} tokens, 99% within {data.p99} (the tokenizer of {model.name})")
    print(f"model: {model.architecture}, {'a' if model.chat_template else 'no'} chat template, context "
          f"{model.max_positions or '?'} tokens, checkpoint in {model.dtype}")
    where = f"{gpus} x {fmt(memory)} GPU" if device == "cuda" else "CPU"
    print(f"plan: max_seq_len {z.max_seq_len}, micro-batch {z.micro_batch} x accumulation {z.accumulation}"
          f"{' x ' + str(gpus) + ' GPUs' if gpus > 1 else ''}, {z.strategy}{' + CPU offload' if z.offload else ''}; "
          f"{fmt(z.planned)} per {'GPU' if device == 'cuda' else 'process'} on {where}; "
          f"{z.eval_split:g} of the rows held out for eval")
    for note in z.notes:
        print(f"note: {note}")
    if stats["rows_skipped"]:
        print(f"note: {stats['rows_skipped']} rows are bad and the recipe stops on them (data.on_bad_row: error); "
              f"fix them, or set data.on_bad_row: skip to train without them. The first: {stats['bad_rows'][0]}")
    print(f"wrote {out} (validated)\nnext:\n  finetune data {out} --show 3      what trains, marked\n"
          f"  finetune validate {out}\n  {launch}")
    return 0

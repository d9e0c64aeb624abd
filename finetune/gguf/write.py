"""`finetune export RUN_DIR --format gguf`: the merged model (or the LoRA adapter alone) as a GGUF file for
llama.cpp and Ollama, written by llama.cpp's own converter (gguf/converter.py) and checked before it appears.

1. The merged model: RUN_DIR/merged when a merge wrote it (merge_info.json), else `finetune merge` first
   (merge/stream.py, same defaults). `--adapter-only` converts RUN_DIR/adapter against its base instead.
2. The converter writes into a temporary sibling of the output file.
3. Every tensor is read back with gguf-py's reader and compared with its source (gguf/readback.py).
4. Where llama-cpp-python is importable, greedy generations of llama.cpp on the run's held-out prompts must
   equal transformers' (gguf/greedy.py); otherwise the result says it was skipped and why.
Only then is the file renamed into place, with a JSON report beside it and, for the merged model, an Ollama
Modelfile (gguf/modelfile.py).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from finetune.gguf import converter
from finetune.util.errors import RecipeError
from finetune.util.sibling import apply_umask, clean_stale, temp_file
from finetune.util.log import log

OUTTYPES = ("f16", "q8_0", "f32")
# Pre-tokenizers the pinned converter does not know by hash (see gguf/llama_shim.py). builtin:tiny-llama's
# tokenizer is tokenizers' ByteLevel(add_prefix_space=False, use_regex=True): it splits text with the GPT-2
# regex ('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+) before byte-level BPE,
# exactly what llama.cpp's "gpt-2" pre-tokenizer (LLAMA_VOCAB_PRE_TYPE_GPT2) does; only the vocabulary
# differs, and that travels in the GGUF. tests/integration/test_export_gguf.py checks the hash still matches
# and that llama.cpp tokenizes like transformers where llama-cpp-python is installed.
PRE_TOKENIZERS = {"475860018a11192b537540fd0c106e46e950b3c4008bf31916219846807d2166": "gpt-2"}


def _merged_dir(run_dir: Path, merged: str | None) -> Path:
    if merged:
        m = Path(merged).expanduser().resolve()
        if not (m / "config.json").is_file():
            raise RecipeError([f"--merged {m}: no config.json (not a merged model directory)"], "export")
        return m
    default = run_dir / "merged"
    if (default / "merge_info.json").is_file():
        return default
    from finetune.merge.stream import merge

    log.info(f"export: no merged model in {default}; merging first")
    return merge(run_dir)


def _converter_failed(proc, what: str) -> RuntimeError:
    lines = (proc.stderr or proc.stdout or "").strip().splitlines()
    failed_write = [ln for ln in lines if ln.startswith(("OSError", "PermissionError"))]
    if failed_write:  # the disk filled up, a quota, a read-only folder: one line, not the converter's traceback
        return RuntimeError(f"export: llama.cpp's {what} could not write the GGUF ({failed_write[-1]}); nothing was "
                            "written to the output. Free space, or choose another --output")
    tail = "\n".join(lines[-15:])
    return RuntimeError(f"export: llama.cpp's {what} failed (exit {proc.returncode}):\n{tail}")


def _weights(directory: Path) -> dict:
    """HF name -> tensor for every safetensors file of `directory` (memory-mapped by safetensors)."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _convert(run_dir: Path, outtype: str, adapter_only: bool, merged: str | None, tmp: Path):
    """Run the converter into `tmp`; returns (sources for the check, config.json dict, what was converted, the
    adapter's scales for `adapter_scale.check_scales`: None for the merged model)."""
    if adapter_only:
        import tempfile

        from finetune.gguf.adapter_scale import portable
        from finetune.merge.source import resolve_source

        src = resolve_source(run_dir)
        _refuse_expert_adapters(src.adapter_dir)
        with tempfile.TemporaryDirectory(prefix="finetune-export-") as scratch:
            # rsLoRA and patterns: written so llama.cpp's alpha / rank gives peft's scale (gguf/adapter_scale.py)
            adapter_dir, scales = portable(src.adapter_dir, Path(scratch) / "adapter")
            args = [str(adapter_dir), "--base", str(src.base_dir), "--outfile", str(tmp), "--outtype", outtype]
            proc = converter.run_converter("convert_lora_to_gguf.py", args, PRE_TOKENIZERS)
            if proc.returncode != 0:
                raise _converter_failed(proc, "convert_lora_to_gguf.py")
            sources = _weights(adapter_dir)
        config = json.loads((src.base_dir / "config.json").read_text())
        return sources, config, src.adapter_dir, scales
    model_dir = _merged_dir(run_dir, merged)
    args = [str(model_dir), "--outfile", str(tmp), "--outtype", outtype]
    proc = converter.run_converter("convert_hf_to_gguf.py", args, PRE_TOKENIZERS)
    if proc.returncode != 0:
        raise _converter_failed(proc, "convert_hf_to_gguf.py")
    return _weights(model_dir), json.loads((model_dir / "config.json").read_text()), model_dir, None


def _refuse_expert_adapters(adapter_dir: Path) -> None:
    """llama.cpp's convert_lora_to_gguf.py knows LoRA on linear layers only: peft's adapters on fused expert
    parameters (lora.target_parameters) end in its 'Unprocessed experts' error. Say so up front (exit 2)."""
    targets = json.loads((adapter_dir / "adapter_config.json").read_text()).get("target_parameters")
    if targets:
        raise RecipeError([f"--adapter-only: {adapter_dir} adapts MoE experts ({', '.join(targets)}), which "
                           "llama.cpp's LoRA converter cannot write; export the merged model (without "
                           "--adapter-only), which holds the expert adapters folded in"], "export")


def _check_inputs(run_dir: Path, adapter_only: bool, merged: str | None) -> None:
    """What export reads, refused before anything is written (exit 2): a damaged adapter (empty or truncated
    adapter_config.json or safetensors), and a chat template the sandbox refuses or that loops."""
    from finetune.gguf.modelfile import check_template
    from finetune.util.untrusted import adapter_problem

    reads_adapter = adapter_only or not (merged or (run_dir / "merged" / "merge_info.json").is_file())
    why = adapter_problem(run_dir / "adapter") if reads_adapter else None
    if why:
        raise RecipeError([why], "export")
    if not adapter_only:  # only the merged GGUF gets a Modelfile made from the template
        check_template(run_dir, _merged_dir(run_dir, merged) if merged else None)


def default_output(run_dir: Path, outtype: str, adapter_only: bool) -> Path:
    return run_dir / "gguf" / f"{'adapter' if adapter_only else 'model'}-{outtype}.gguf"


def _written_mark(gguf: Path) -> dict:
    """What export's report records of the GGUF it wrote: its size and a digest of its first MiB (the header,
    the tensor index and the first data), cheap enough to check before replacing a file of many GiB."""
    import hashlib

    with open(gguf, "rb") as f:
        head = f.read(1 << 20)
    return {"bytes": gguf.stat().st_size, "head_sha256": hashlib.sha256(head).hexdigest()}


def write_report(out: Path, report: dict) -> None:
    """OUTPUT.json, the check report, through the no-follow temporary and rename (a link planted at either
    name is never written through), with the mark that lets a later export know it wrote OUTPUT."""
    from finetune.util.atomic import write_text

    report["written"] = _written_mark(out)
    write_text(out.with_name(out.name + ".json"), json.dumps(report, indent=2, sort_keys=True) + "\n")


def wrote_it(out: Path) -> bool:
    """Whether `out` is the GGUF an earlier export wrote: its report beside it names this very file."""
    try:
        report = json.loads(out.with_name(out.name + ".json").read_text())
        return isinstance(report, dict) and report.get("written") == _written_mark(out)
    except (OSError, ValueError):
        return False


def refuse_foreign_output(out: Path, force: bool = False) -> None:
    """--output replaces only a GGUF file an earlier export wrote (its report beside it matches it), unless
    --force: never a directory, a link or another file (the run's own adapter or recipe), and never a GGUF
    from elsewhere (a downloaded base model) without --force (exit 2)."""
    if out.is_dir() or out.is_symlink():
        raise RecipeError([f"--output: {out} is a {'directory' if out.is_dir() else 'symbolic link'}; name the GGUF "
                           "file to write, e.g. --output model.gguf"], "export")
    if out.exists():
        with open(out, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise RecipeError([f"--output: {out} exists and is not a GGUF file that export wrote; name a new file "
                               "(export never replaces other files)"], "export")
        if not force and not wrote_it(out):
            raise RecipeError([f"--output: {out} is a GGUF file that export did not write (no matching "
                               f"{out.name}.json report beside it); name a new file, or add --force to replace "
                               "it"], "export")


def refuse_planted(run_dir: Path, out: Path) -> None:
    """A symbolic link planted where export writes (RUN/gguf, the GGUF's report, its Modelfile, their
    temporaries) is exit 2 naming it, before anything is converted: nothing is written through a link."""
    from finetune.util.atomic import temp_name

    names = [out.with_name(out.name + ".json"), out.with_suffix(".Modelfile")]
    found = [p for p in names + [temp_name(p) for p in names] if p.is_symlink()]
    if out.parent == run_dir / "gguf" and out.parent.is_symlink():
        found.insert(0, out.parent)
    if found:
        raise RecipeError([f"{p} is a symbolic link (to {os.readlink(p)}); export does not write through links: "
                           "remove it" for p in found], "export")


def refuse_unsafe_name(out: Path) -> None:
    """The output's path lands in generated text (the Modelfile's header comment, its `ollama create` line, its
    FROM line, the report): a control character (a line break) there would add Ollama directives. Exit 2
    before anything is written."""
    import re

    bad = re.search(r"[\x00-\x1f\x7f]", str(out))
    if bad:
        raise RecipeError([f"--output: {str(out)!r} holds the control character {bad.group()!r}, which would "
                           "break the lines of the Modelfile written beside it; choose a name without one"],
                          "export")


def export_gguf(run_dir, outtype: str = "f16", adapter_only: bool = False, output: str | None = None,
                merged: str | None = None, greedy_prompts: int = 200, force: bool = False) -> dict:
    """Convert, check, then publish OUTPUT (and OUTPUT.json, the check report). RuntimeError when a check
    fails (nothing is published); RecipeError for bad input or a missing converter."""
    from finetune.gguf.readback import check_tensors

    from finetune.gguf import quantizer

    if outtype not in OUTTYPES + tuple(quantizer.KQUANTS):
        raise RecipeError([f"--outtype: expected one of {', '.join(OUTTYPES + tuple(quantizer.KQUANTS))}, got "
                           f"{outtype!r}"], "export")
    if outtype in quantizer.KQUANTS:
        if adapter_only:
            raise RecipeError([f"--outtype {outtype} --adapter-only: llama.cpp applies LoRA GGUFs in f16/f32/q8_0; "
                               "quantize the merged model instead (without --adapter-only)"], "export")
        return _export_kquant(run_dir, outtype, output, merged, greedy_prompts, force)
    run_dir = Path(run_dir).expanduser().resolve()
    out = Path(output).expanduser().resolve() if output else default_output(run_dir, outtype, adapter_only)
    refuse_unsafe_name(out)
    conv = converter.require()
    if not (run_dir / "adapter" / "adapter_config.json").is_file() and not (merged and not adapter_only):
        raise RecipeError([f"{run_dir} is not a run dir (no adapter/adapter_config.json)"], "export")
    refuse_planted(run_dir, out)
    refuse_foreign_output(out, force)
    _check_inputs(run_dir, adapter_only, merged)
    clean_stale(out, "export")  # the hidden full-size temporary of an export killed mid-write
    with temp_file(out) as tmp:
        sources, config, converted, scales = _convert(run_dir, outtype, adapter_only, merged, tmp)
        tensors = check_tensors(conv, tmp, sources, config, lora=adapter_only)
        report = {"format": "gguf", "outtype": outtype, "adapter_only": adapter_only, "source": str(converted),
                  "converter": f"llama.cpp convert_{'lora' if adapter_only else 'hf'}_to_gguf.py from "
                               f"llama-cpp-python=={converter.PIN}", "tensors": tensors}
        if scales is not None:  # the scale llama.cpp applies, module by module, against peft's
            from finetune.gguf.adapter_scale import check_scales
            from finetune.gguf.readback import gguf_module

            report["scaling"] = check_scales(gguf_module(conv), tmp, scales)
        if tensors["mismatched"]:
            raise RuntimeError(f"export: {len(tensors['mismatched'])} GGUF tensor(s) differ from their source, "
                               f"e.g. {tensors['mismatched'][0]}; nothing was written to {out}")
        report["greedy"] = _greedy(run_dir, converted, tmp, adapter_only, greedy_prompts)
        if report["greedy"].get("status") == "failed":
            raise RuntimeError(f"export: llama.cpp's greedy outputs differ from transformers': "
                               f"{report['greedy']['summary']}; nothing was written to {out}")
        apply_umask(tmp)  # mkstemp makes 0600
        os.replace(tmp, out)
    write_report(out, report)
    if not adapter_only:  # Ollama serves the merged GGUF; an adapter GGUF needs a base GGUF this export lacks
        from finetune.gguf.modelfile import write_modelfile

        report["modelfile"] = str(write_modelfile(out, run_dir, converted))
    return {"output": str(out), **report}


def _greedy(run_dir: Path, converted: Path, gguf_file: Path, adapter_only: bool, n: int) -> dict:
    import importlib.util

    if n <= 0:
        return {"status": "skipped (--greedy-prompts 0)"}
    if importlib.util.find_spec("llama_cpp") is None:
        return {"status": "skipped: llama-cpp-python is not installed (pip install llama-cpp-python=="
                          f"{converter.PIN} to compare llama.cpp's greedy outputs with transformers')"}
    if adapter_only:
        return {"status": "skipped: the greedy comparison runs on the merged GGUF (llama.cpp applies a LoRA "
                          "GGUF over a base GGUF, which this export does not write)"}
    from finetune.gguf.greedy import greedy_parity

    return greedy_parity(run_dir, converted, gguf_file, n)


def _quantized_tensors(binary: str, src: Path, tmp: Path, out: Path, f16: dict) -> dict:
    """check_tensors of what llama-quantize wrote into `tmp`; RunError (exit 3) naming the binary when it exited 0
    but wrote no GGUF (nothing, an empty file, other bytes, a file gguf-py cannot read, a GGUF missing tensors)."""
    from finetune.gguf import quantizer
    from finetune.gguf.readback import check_tensors
    from finetune.util.errors import RunError

    sources = _weights(Path(f16["source"]))
    config = json.loads((Path(f16["source"]) / "config.json").read_text())
    why = quantizer.output_problem(binary, tmp)
    tensors = {}
    if why is None:
        try:
            tensors = check_tensors(converter.require(), tmp, sources, config)
        except Exception as e:  # noqa: BLE001 - gguf-py fails on a malformed file with assorted errors
            why = (f"{binary} exited 0 but wrote {tmp.stat().st_size} bytes that gguf-py cannot read as GGUF "
                   f"({type(e).__name__}: {str(e)[:120]})")
    if not why and tensors["tensors"] != f16["tensors"]["tensors"]:  # a GGUF, but not all of the model
        why = f"{binary} exited 0 but wrote a GGUF of {tensors['tensors']} tensors where {src.name} has " \
              f"{f16['tensors']['tensors']}"
    if why:
        raise RunError([f"wrote and checked {src}; {why}. Nothing was written to {out}; check that binary "
                        f"(llama.cpp's llama-quantize at llama-cpp-python=={converter.PIN})"], "export")
    return tensors


def _export_kquant(run_dir, outtype: str, output: str | None, merged: str | None, greedy_prompts: int,
                   force: bool = False) -> dict:
    """A K-quant GGUF (q4_k_m, ...): the checked f16 export first (kept: it is the quantizer's input and a
    GGUF of its own), then llama-quantize into a temporary sibling of the output, every tensor read back
    within its type's error bound, and only then the rename. Without llama-quantize: RunError (exit 3) after
    the f16 file is written, naming the command that finishes the job."""
    from finetune.gguf import quantizer
    from finetune.util.errors import RunError

    run_dir = Path(run_dir).expanduser().resolve()
    out = Path(output).expanduser().resolve() if output else default_output(run_dir, outtype, False)
    refuse_unsafe_name(out)
    refuse_planted(run_dir, out)
    refuse_foreign_output(out, force)
    f16 = export_gguf(run_dir, "f16", False, str(out.with_name(out.stem + ".f16.gguf")) if output else None, merged,
                      greedy_prompts=0, force=force)  # the greedy check runs once, on the file people serve
    src = Path(f16["output"])
    binary = quantizer.find()
    if binary is None:
        raise RunError([f"wrote and checked {src}; " + quantizer.missing_advice(src, out, outtype)], "export")
    clean_stale(out, "export")
    with temp_file(out) as tmp:
        proc = quantizer.quantize(binary, src, tmp, outtype)
        if proc.returncode != 0:
            raise _converter_failed(proc, "llama-quantize")
        tensors = _quantized_tensors(binary, src, tmp, out, f16)
        if tensors["mismatched"]:
            raise RuntimeError(f"export: {len(tensors['mismatched'])} {outtype} tensor(s) are further from their "
                               f"source than the type allows, e.g. {tensors['mismatched'][0]}; nothing was "
                               f"written to {out}")
        report = {"format": "gguf", "outtype": outtype, "adapter_only": False, "source": f16["source"],
                  "quantized_from": str(src), "quantizer": f"{binary} ({quantizer.KQUANTS[outtype]})",
                  "converter": f16["converter"], "tensors": tensors,
                  "greedy": _greedy(run_dir, Path(f16["source"]), tmp, False, greedy_prompts)}
        if report["greedy"].get("status") == "failed":
            raise RuntimeError(f"export: llama.cpp's greedy outputs differ from transformers': "
                               f"{report['greedy']['summary']}; nothing was written to {out}")
        apply_umask(tmp)
        os.replace(tmp, out)
    write_report(out, report)
    from finetune.gguf.modelfile import write_modelfile

    report["modelfile"] = str(write_modelfile(out, run_dir, Path(f16["source"])))
    return {"output": str(out), **report}

"""`finetune export RUN_DIR --format gguf [--outtype f16|q8_0|f32] [--adapter-only]`: the merged model (or the
LoRA adapter alone) as GGUF for llama.cpp and Ollama, by llama.cpp's own converter at a pinned release, checked
against the weights it came from before it appears (gguf/write.py)."""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("export", help="write the model as GGUF (llama.cpp, Ollama), checked",
                       description="Convert RUN_DIR's merged model (merging first when needed), or with "
                                   "--adapter-only its LoRA adapter, to GGUF with llama.cpp's own converter; "
                                   "every tensor is read back and compared, and where llama-cpp-python is "
                                   "installed greedy outputs on held-out prompts must equal transformers'.")
    p.add_argument("run_dir", help="run dir (recipe.yaml + adapter/)")
    p.add_argument("--format", choices=["gguf"], default="gguf", help="output format (only gguf)")
    p.add_argument("--outtype", choices=["f16", "q8_0", "f32", "q4_k_m", "q5_k_m", "q6_k"], default="f16",
                   help="tensor type of the weights; the K-quants (q4_k_m, ...) go through llama.cpp's "
                        "llama-quantize (python -m finetune.gguf.quantizer --build makes one)")
    p.add_argument("--adapter-only", action="store_true",
                   help="convert only the LoRA adapter (llama.cpp --lora over a GGUF of the base)")
    p.add_argument("--output", help="GGUF file to write (default RUN_DIR/gguf/{model,adapter}-OUTTYPE.gguf)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing GGUF at --output that this export did not write (e.g. a downloaded one)")
    p.add_argument("--merged", help="a merged model directory to convert instead of RUN_DIR/merged")
    p.add_argument("--greedy-prompts", type=int, default=200,
                   help="held-out prompts for the llama.cpp vs transformers greedy check (0: skip)")
    p.set_defaults(run=run)


def run(args) -> int:
    import json
    import sys

    from finetune.gguf.write import export_gguf

    try:
        res = export_gguf(args.run_dir, args.outtype, args.adapter_only, args.output, args.merged,
                          args.greedy_prompts, args.force)
    except RuntimeError as e:  # a failed check or converter: nothing was written
        print(f"error: {e}", file=sys.stderr)
        return 1
    t = res["tensors"]
    if res.get("quantized_from"):
        print(f"wrote {res['quantized_from']} (f16, checked) and quantized it with {res['quantizer']}")
    agree = "are within their type's error bound of" if res.get("quantized_from") else "equal"
    print(f"wrote {res['output']}: {t['checked']} tensors {agree} their source "
          f"({', '.join(f'{k} {v}' for k, v in sorted(t['types'].items()))}; max abs diff "
          f"{json.dumps(t['max_abs_diff'], sort_keys=True)}); greedy check: "
          f"{res['greedy'].get('summary') or res['greedy']['status']}")
    if res.get("modelfile"):
        print(f"wrote {res['modelfile']}: for Ollama, `ollama create NAME -f {res['modelfile']}`")
    return 0

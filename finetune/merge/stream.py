"""`finetune merge RUN_DIR`: fold a LoRA adapter into its base and write one servable model.

Streaming by construction: the base is read one safetensors shard at a time (never the whole model,
never 4-bit weights), each targeted weight gets (alpha/r) * B @ A added in fp32 (and, for DoRA, each row
rescaled to its learned magnitude) and is rounded once to the output dtype, and output shards are written
as they fill. Peak memory is about one input shard plus one output shard, whatever the model size (benchmarks/cpu/merge_rss.py measures it).

Targets: `original` adds the update to the base weights as published; `nf4` adds it to each weight as
training saw it (cast to the recipe's model dtype, 4-bit quantized, dequantized), so the merged model
computes what the trained adapter computed. See docs/merge.md for when to pick which.

Safe: everything is written to a temporary sibling directory and renamed into place only after the
parity check passed, so a crash or a failed check never leaves an output that looks complete; what may be
replaced, permissions, leftovers and write errors are `finetune.merge.output`'s.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from finetune.merge import experts
from finetune.merge.plan import (OUT_DTYPES, TensorInfo, lora_delta, magnitude_keys, merged_tensor, out_nbytes,
                                 pair_keys, plan_shards, scaling, shard_names)
from finetune.merge.output import SMALL_FILES_MARGIN, output_dir, space_problem, up_to_date, write_error
from finetune.util.sibling import apply_umask, carried_oserror, clean_stale, temp_dir
from finetune.merge.source import Source, base_tensors, four_bit_weights, quant_spec, resolve_source
from finetune.artefacts.tokenizer import save_tokenizer
from finetune.util.atomic import replace_dir
from finetune.util.digest import file_sha256
from finetune.util.dtypes import recipe_name, torch_dtype
from finetune.util.errors import RecipeError
from finetune.util.libc import map_large_buffers, trim_heap
from finetune.util.log import log
from finetune.util.units import parse_size

FORMAT_VERSION = 1  # bump when the output layout or arithmetic changes: old outputs are then not "up to date"


def _adapter_pairs(src: Source, infos: list[TensorInfo]):
    """The open adapter file and {base weight name: (lora_A key, lora_B key)}, checked against the base."""
    from safetensors import safe_open

    adapter = src.adapter_dir / "adapter_model.safetensors"
    if not adapter.is_file():
        raise RecipeError([f"{adapter} not found (merge reads safetensors adapters only)"], "merge")
    ad = safe_open(str(adapter), framework="pt")  # small; read one A/B pair at a time anyway
    pairs, shapes = pair_keys(ad.keys()), {t.name: t.shape for t in infos}
    by_weight = {f"{mod}.weight": ab for mod, ab in pairs.items() if f"{mod}.weight" in shapes}
    if len(by_weight) < len(pairs):  # LoRA on fused MoE expert parameters (merge/experts.py)
        base_cfg = json.loads((src.base_dir / "config.json").read_text())
        n = base_cfg.get("num_local_experts") or base_cfg.get("num_experts") or 0
        by_weight.update(experts.resolve(pairs, src.adapter_config, shapes, base_cfg.get("model_type", ""), n))
    missing = sorted(set(by_weight) - {t.name for t in infos})
    if missing:
        raise RecipeError([f"the adapter targets {len(missing)} weights the base does not have, e.g. "
                           f"{missing[0]}: wrong base model?"], "merge")
    return ad, by_weight


class _Merger:
    """The output tensors, one at a time in the planned order: the base tensor as the target says training
    held it, plus its LoRA update if the adapter has one. Records the scale of every merged weight."""

    def __init__(self, src: Source, infos: list[TensorInfo], target: str, out_dtype: torch.dtype):
        self.src, self.out_dtype = src, out_dtype
        self.adapter, self.by_weight = _adapter_pairs(src, infos)
        self.magnitudes = {f"{mod}.weight": key for mod, key in magnitude_keys(self.adapter.keys()).items()}
        if src.adapter_config.get("use_dora") and len(self.magnitudes) < len(self.by_weight):
            # Merged as plain LoRA, a DoRA adapter would be silently wrong: every layer needs its magnitude.
            raise RecipeError([f"adapter_config.json says use_dora, but {len(self.by_weight) - len(self.magnitudes)}"
                               f" of {len(self.by_weight)} adapted weights have no DoRA magnitude "
                               "(lora_magnitude_vector) in adapter_model.safetensors: a damaged or mislabelled "
                               "adapter"], "adapter")
        base_cfg = json.loads((src.base_dir / "config.json").read_text())
        self.n_experts = base_cfg.get("num_local_experts") or base_cfg.get("num_experts") or 0
        self.model_type, self.sources = base_cfg.get("model_type", ""), {t.name: t.source for t in infos}
        self.quant, self.four_bit = None, set()
        if target == "nf4":
            self.quant, self.four_bit = quant_spec(src.recipe), four_bit_weights(src.base_dir)
        self.scales: dict[str, float] = {}
        self.handle, self.handle_name = None, None

    def tensor(self, t: TensorInfo) -> torch.Tensor:
        from safetensors import safe_open

        if self.handle_name != t.source:  # input shards are visited in order: one open at a time
            self.handle, self.handle_name = safe_open(str(self.src.base_dir / t.source), framework="pt"), t.source
        delta = self._delta(t)
        quant, w = self.quant, self.handle.get_tensor(t.name)
        four_bit = quant if t.name in self.four_bit else None
        if quant is not None:  # MoE experts were 4-bit too, each expert quantized alone
            trained = experts.as_trained(t.name, w, self._read, quant, self.model_type, self.n_experts)
            w, four_bit = (w, four_bit) if trained is None else (trained, None)
        mag = self.adapter.get_tensor(self.magnitudes[t.name]) if t.name in self.magnitudes else None
        return merged_tensor(w, self.out_dtype, delta, quant=four_bit,
                             cast_to=quant.dtype if quant is not None else None, magnitude=mag)

    def _read(self, name: str) -> torch.Tensor:
        """Another base tensor (an expert's other part), read alone."""
        from safetensors import safe_open

        with safe_open(str(self.src.base_dir / self.sources[name]), framework="pt") as f:
            return f.get_tensor(name)

    def _delta(self, t: TensorInfo) -> torch.Tensor | None:
        name, how = t.name, self.by_weight.get(t.name)
        if how is None:
            return None
        if isinstance(how, experts.ExpertUpdate):
            a, b = self.adapter.get_tensor(how.keys[0]), self.adapter.get_tensor(how.keys[1])
            n = t.shape[0] if how.expert is None else self.n_experts
            self.scales[name] = scaling(self.src.adapter_config, how.fused, experts.rank(a, n))
            return experts.expert_delta(a, b, n, self.scales[name], how)
        ka, kb = how
        a, b = self.adapter.get_tensor(ka), self.adapter.get_tensor(kb)
        self.scales[name] = scaling(self.src.adapter_config, name.removesuffix(".weight"), a.shape[0])
        return lora_delta(a, b, self.scales[name])


def _save_shard(save_file, tensors: dict, path: Path):
    """safetensors writes the file itself and reports a failed write (disk full, quota) as a SafetensorError
    whose only trace of the errno is its message ("os error 28"); turn it back into the OSError it was, so
    it is reported like every other failed write. (Serializing to bytes first would cost a shard of RAM.)"""
    from safetensors import SafetensorError

    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except SafetensorError as e:
        carried = carried_oserror(e, path)
        if carried is None:
            raise
        raise carried from None


def _write_shards(src: Source, tmp: Path, target: str, out_dtype: torch.dtype, max_bytes: int) -> dict:
    """The merged weights as planned output shards (+ index), each written as soon as it is full."""
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    map_large_buffers()  # a fixed peak: freed output shards go back to the OS
    infos = base_tensors(src.base_dir)
    merger = _Merger(src, infos, target, out_dtype)
    shards = plan_shards(infos, out_dtype, max_bytes)
    names = shard_names(len(shards))
    weight_map, total = {}, 0
    for shard, fname in tqdm(list(zip(shards, names)), desc="merge", unit="shard", disable=None):
        tensors = {}
        for t in shard:
            tensors[t.name] = merger.tensor(t)
            weight_map[t.name] = fname
            total += tensors[t.name].numel() * tensors[t.name].element_size()
        _save_shard(save_file, tensors, tmp / fname)
        del tensors
        trim_heap()  # small allocations still come from the heap, which keeps their freed chunks
    merger.handle = None  # unmap the last input shard before the next step reads more
    if len(names) > 1:
        (tmp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n")
    return {"shards": len(names), "bytes": total, "merged_weights": len(merger.scales),
            "scales": sorted(set(merger.scales.values())), "four_bit_weights": len(merger.four_bit & set(weight_map))}


def _write_extras(src: Source, tmp: Path, out_dtype: torch.dtype) -> None:
    """config (dtype set, no quantization), generation config, tokenizer (the adapter's, which training
    saved with its chat template; else the base's)."""
    from transformers import AutoTokenizer

    cfg = json.loads((src.base_dir / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = recipe_name(out_dtype)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if (src.base_dir / "generation_config.json").is_file():
        (tmp / "generation_config.json").write_bytes((src.base_dir / "generation_config.json").read_bytes())
    try:
        tok = AutoTokenizer.from_pretrained(tokenizer_dir(src))
    except (ValueError, OSError) as e:
        raise RecipeError([f"cannot load the tokenizer in {tokenizer_dir(src)}: {str(e).splitlines()[0]}"],
                          "merge") from None
    try:
        save_tokenizer(tok, tmp)  # portable form (artefacts/)
    except Exception as e:  # noqa: BLE001 - tokenizers reports a failed write as a bare Exception ("os error 28")
        carried = OSError(e.errno, e.strerror, e.filename or str(tmp)) if isinstance(e, OSError) \
            else carried_oserror(e, tmp / "tokenizer.json")  # (a failed close names no file: the dir it was in)
        if carried is None:
            raise
        raise carried from None


TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model")


def tokenizer_dir(src: Source) -> Path:
    """The adapter's tokenizer (training saves it with its chat template), else the base's; RecipeError
    before anything is written when neither has one."""
    for d in (src.adapter_dir, src.base_dir):
        if any((d / name).is_file() for name in TOKENIZER_FILES):
            return d
    raise RecipeError([f"no tokenizer in the adapter ({src.adapter_dir}) nor the base ({src.base_dir}): a merged "
                       "model needs one; copy the base model's tokenizer files into either"], "merge")


def fingerprint(src: Source, target: str, dtype: str, max_bytes: int) -> dict:
    """What the output depends on. Base shards by name and size (hashing a 140 GB base on every run
    would cost more than the merge); the adapter by content."""
    base_files = sorted((p.name, p.stat().st_size) for p in src.base_dir.glob("*.safetensors"))
    fp = {"format": FORMAT_VERSION, "base": src.base_name, "base_files": base_files,
          "adapter_sha256": file_sha256(src.adapter_dir / "adapter_model.safetensors"),
          "target": target, "dtype": dtype, "max_shard_size": max_bytes}
    return json.loads(json.dumps(fp))  # the form it takes in merge_info.json, so the two compare equal


def _check_options(target: str, dtype: str, max_shard_size) -> int:
    """The CLI's choices, checked again for callers of merge(); returns the shard limit in bytes."""
    if target not in ("original", "nf4"):
        raise RecipeError([f"--target: expected original or nf4, got {target!r}"], "merge")
    if dtype not in OUT_DTYPES:
        raise RecipeError([f"--dtype: expected one of {', '.join(OUT_DTYPES)}, got {dtype!r}"], "merge")
    return parse_size(max_shard_size, "--max-shard-size")


def _write_output(src: Source, tmp: Path, out: Path, target: str, dtype: str, max_bytes: int, fp: dict,
                  check: bool) -> dict:
    """Weights, config, tokenizer, parity check, model card and merge_info.json into `tmp`; returns the
    shard stats. RuntimeError when the parity check failed (`out` is then left as it was)."""
    from finetune.merge.card import model_card
    from finetune.merge.check import parity_check

    stats = _write_shards(src, tmp, target, torch_dtype(dtype), max_bytes)
    _write_extras(src, tmp, torch_dtype(dtype))
    result = parity_check(src, tmp, target) if check else {"status": "skipped (--no-check)"}
    log.info(f"merge: parity {result['status']}" + (f": {result['summary']}" if "summary" in result else ""))
    tok_cfg = json.loads((tmp / "tokenizer_config.json").read_text())
    (tmp / "README.md").write_text(model_card(src, target, dtype, stats, result, tok_cfg))
    (tmp / "merge_info.json").write_text(json.dumps(
        {"inputs": fp, "stats": stats, "parity": result}, indent=2, sort_keys=True) + "\n")
    if result["status"] == "failed":
        raise RuntimeError(f"merge parity check failed: {result['summary']}; nothing was written to {out}")
    return stats


def planned_bytes(src: Source, dtype: str) -> int:
    """What a merge writes: every base tensor in the output dtype, the tokenizer's files and the small ones."""
    weights = sum(out_nbytes(t, torch_dtype(dtype)) for t in base_tensors(src.base_dir))
    tokenizer = sum(f.stat().st_size for f in tokenizer_dir(src).iterdir()
                    if f.is_file() and f.suffix != ".safetensors")
    return weights + tokenizer + SMALL_FILES_MARGIN


def merge(source, output=None, target: str = "original", dtype: str = "bf16", max_shard_size="5GB",
          force: bool = False, check: bool = True) -> Path:
    """Merge the adapter of `source` (run dir or PEFT adapter dir) into its base; returns the output dir."""
    max_bytes = _check_options(target, dtype, max_shard_size)
    src = resolve_source(source)
    out = output_dir(src, output)
    tokenizer_dir(src)
    fp = fingerprint(src, target, dtype, max_bytes)
    if up_to_date(out, fp, force):
        log.info(f"merge: {out} is up to date (same adapter, base and settings); nothing to do")
        return out
    need = planned_bytes(src, dtype)
    full = space_problem(out, need)
    if full:
        raise full
    try:
        clean_stale(out, "merge")
        with temp_dir(out) as tmp:
            stats = _write_output(src, tmp, out, target, dtype, max_bytes, fp, check)
            apply_umask(tmp)
            replace_dir(tmp, out)  # at every instant `out` is the old complete output or the new one
    except OSError as e:  # read-only output, disk full, quota: one line, nothing partial left
        raise write_error(e, out, need) from None
    log.info(f"merge: wrote {stats['shards']} shard(s), {stats['bytes'] / 1e6:.1f} MB, "
             f"{stats['merged_weights']} merged weights -> {out}")
    return out

"""The streaming loader (weights/load/reader.py, weights/load/skeleton.py) under FSDP, 2 processes over gloo: each rank holds
only its shard of the packed 4-bit weights, and that shard is byte for byte the matching slice of what one
process loads; quantization state is whole and equal on every rank; a pre-quantized checkpoint written by
the project loads in 1 and 2 processes without quantizing and gives the same logits."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ..conftest import warm_launch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).parent / "stream_worker.py"
sys.path.insert(0, str(WORKER.parent))
import stream_worker  # noqa: E402 - the worker's own readers of what a rank holds

SYNTH = "synthetic:meta-llama/Meta-Llama-3-8B?layers=2&hidden=256&intermediate=768&heads=4&kv_heads=2&vocab=1000"


def _run(out: Path, model: str, nproc: int, *args: str) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    if nproc == 1:
        launcher, args = [sys.executable], (*args, "--strategy", "single")
    cmd = [*launcher, str(WORKER), str(out), model, *args]
    cmd, env = warm_launch(cmd, env) if nproc > 1 else (cmd, env)
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(nproc)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from finetune.weights.load.resolve import resolve_name

    return resolve_name(SYNTH)


@pytest.fixture(scope="module")
def reference(model_dir):
    """One plain process: the whole packed weights and quantization state of every Linear4bit."""
    from finetune.recipe import ModelSpec, QuantizationSpec
    from finetune.weights.load.model import load_model

    model = load_model(ModelSpec(name=model_dir, gradient_checkpointing=False), QuantizationSpec(), quiet=True)
    return stream_worker.fsdp2_holdings(model), model


def _equal_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _two_machines(out: Path, model: str) -> list[dict]:
    """2 FSDP2 processes launched as two machines of one process each (two torchrun agents, node ranks 0
    and 1): each is its own machine's reader."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    logs = [out.parent / f"{out.name}-node{n}.log" for n in (0, 1)]
    cmds = [warm_launch([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                         f"--node_rank={n}", "--master_addr=127.0.0.1", f"--master_port={port}",
                         str(WORKER), str(out), model, "--version", "2"], env) for n in (0, 1)]
    procs = [subprocess.Popen(cmd, env=e, stdout=logs[n].open("w"), stderr=subprocess.STDOUT)
             for n, (cmd, e) in enumerate(cmds)]
    codes = [p.wait(timeout=300) for p in procs]
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _assert_fsdp2_chunks(ref: dict, ranks: list[dict]) -> None:
    assert ref and ranks[0]["fsdp2"].keys() == ref.keys()
    for name, whole in ref.items():
        packed = whole["packed"].view(whole["rows"], -1)
        chunks = torch.chunk(packed, 2, dim=0)
        for r, facts in enumerate(ranks):
            held = facts["fsdp2"][name]
            # FSDP2 pads the last chunk to the first's size; the rows past the whole tensor are padding.
            rows = chunks[r].shape[0]
            assert held["rows"] == chunks[0].shape[0] and rows <= held["rows"]
            assert torch.equal(held["packed"].view(held["rows"], -1)[:rows], chunks[r]), (name, r)
            assert _equal_state(held["quant_state"], whole["quant_state"]), (name, r)
    total = sum(f["fsdp2"][n]["packed"].numel() for f in ranks for n in ref)
    assert total <= sum(w["packed"].numel() for w in ref.values()) + 2 * len(ref) * 16  # halves, not wholes
    torch.testing.assert_close(ranks[0]["logits"], ranks[1]["logits"])


# Pieces of 24 rows of 256 (QUANT_CHUNK 6144 elements) against the reference's one piece per weight: the
# packed bytes are the same, and a rank's part of a weight begins or ends inside a piece.
SMALL_PIECES = ("--quant-chunk", str(3 * 2**11))


def test_fsdp2_ranks_hold_their_chunk_of_one_process_load(tmp_path, reference):
    ranks = _run(tmp_path, SYNTH, 2, "--version", "2", *SMALL_PIECES)
    _assert_fsdp2_chunks(reference[0], ranks)
    assert [r["reader"] for r in ranks] == [0, 0]  # one machine: rank 0 reads for both


def test_fsdp2_leaves_the_frozen_tables_whole_on_every_rank(tmp_path, reference):
    """The frozen input embedding and output head are replicated (parallel.replicated_modules), not sharded:
    every rank holds them whole, equal to a one-process load, and no step all-gathers them."""
    ranks = _run(tmp_path, SYNTH, 2, "--version", "2")
    one = reference[1]
    for key, whole in (("embed", one.get_input_embeddings().weight), ("head", one.get_output_embeddings().weight)):
        for r, facts in enumerate(ranks):
            held = facts["tables"][key]
            assert not held["sharded"], (key, r)
            assert torch.equal(held["local"], whole.detach()), (key, r)


def test_one_reader_per_machine(tmp_path, reference):
    """Two machines: each machine's local rank 0 reads for its own machine (its own process group), and the
    shards are the same as with one reader."""
    ranks = _two_machines(tmp_path / "out", SYNTH)
    _assert_fsdp2_chunks(reference[0], ranks)
    assert [r["reader"] for r in ranks] == [0, 1]  # each machine's local rank 0 reads


def test_fsdp1_flat_shards_are_slices_of_one_process_load(tmp_path, reference):
    _, model = reference
    whole = {n: p.detach().contiguous().view(-1).view(torch.uint8) for n, p in model.named_parameters()}
    ranks = _run(tmp_path, SYNTH, 2, "--version", "1", *SMALL_PIECES)
    seen = set()
    for facts in ranks:
        for unit in facts["fsdp1"]:
            flat, size = unit["flat"], unit["itemsize"]
            for name, offset, numel, start in unit["infos"]:
                if name not in whole:
                    continue  # LoRA adapters: not part of the base
                seen.add(name)
                held = flat[offset * size:(offset + numel) * size]
                assert torch.equal(held, whole[name][start * size:(start + numel) * size]), name
    packed = {n for n in whole if "proj.weight" in n}
    assert packed and packed <= seen  # every 4-bit weight was checked on some rank
    shard_bytes = [sum(u["flat"].numel() for u in f["fsdp1"]) for f in ranks]
    assert max(shard_bytes) < 0.6 * sum(t.numel() for t in whole.values())


def test_prequantized_checkpoint_loads_without_quantizing(tmp_path, model_dir, reference, monkeypatch):
    import bitsandbytes.functional as F

    from finetune.recipe import ModelSpec, QuantizationSpec
    from finetune.weights.load import quantize, reader
    from finetune.weights.load.model import load_model

    ref, model = reference
    from finetune import cli

    pre = tmp_path / "pre"  # written by the project's own verb: `finetune quantize RECIPE --output DIR`
    assert cli.main(["quantize", str(REPO / "recipes" / "tiny_cpu.yaml"), f"model.name={model_dir}",
                     "--output", str(pre)]) == 0

    def refuse(*a, **k):
        raise AssertionError("quantize_4bit was called")
    monkeypatch.setattr(F, "quantize_4bit", refuse)
    monkeypatch.setattr(quantize, "quantize", refuse)  # the loader's own (piecewise) quantization
    monkeypatch.setattr(quantize, "quantize_piece", refuse)
    monkeypatch.setattr(reader, "quantize_from", refuse)
    one = load_model(ModelSpec(name=str(pre), gradient_checkpointing=False), QuantizationSpec(), quiet=True)
    got = stream_worker.fsdp2_holdings(one)
    for name, whole in ref.items():
        assert torch.equal(got[name]["packed"], whole["packed"]), name
        assert _equal_state(got[name]["quant_state"], whole["quant_state"]), name
    ids = torch.arange(24).view(2, 12) % 300
    with torch.no_grad():
        base_logits = model(input_ids=ids).logits.float()
        torch.testing.assert_close(one(input_ids=ids).logits.float(), base_logits, rtol=0, atol=0)
    two = _run(tmp_path / "two", str(pre), 2, "--version", "2", "--no-quantize")
    # Under FSDP the adapters are attached (B = 0: they add nothing) and the forward runs sharded.
    torch.testing.assert_close(two[0]["logits"], base_logits, rtol=1e-5, atol=1e-5)


def test_synthetic_model_trains_on_synthetic_tokens_over_its_whole_vocabulary(tmp_path, model_dir):
    """A synthetic model whose vocabulary (1000) is not the tiny tokenizer's (384) trains on
    `synthetic:tokens` rows drawn over all 1000 ids: the loss starts near ln(1000) (random weights, uniform
    ids) and the ids above the tokenizer's reach the model, where an out-of-range id would fail the lookup."""
    import json
    import math

    from finetune import recipe as R
    from finetune.train.loop import train

    r = R.from_dict({
        "model": {"name": SYNTH, "gradient_checkpointing": False},
        "data": {"sources": [{"path": "synthetic:tokens?rows=48&min_len=16&max_len=32"}], "eval_split": 0.1,
                 "max_seq_len": 32},
        "train": {"micro_batch_size": 4, "max_steps": 3, "learning_rate": 1e-3, "log_every": 1},
        "eval": {"max_batches": 1, "exact_match_samples": 0},
        "output": {"dir": str(tmp_path / "run"), "progress_bar": False},
    })
    train(r, tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row]
    assert len(losses) == 3 and all(abs(v - math.log(1000)) < 1.0 for v in losses), losses

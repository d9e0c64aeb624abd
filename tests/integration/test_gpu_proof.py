"""The GPU proof's dry run (`python -m benchmarks.gpu.proof --dry-run`): every stage on tiny shapes on the CPU,
the files it writes, and a short deadline that skips stages cleanly. Also the bitsandbytes-1945 check
(benchmarks/gpu/bytecheck.py) over gloo with 2 processes on weights whose packed bytes are mostly bf16 NaNs."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ..conftest import warm_launch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow]


def proof(out: Path, work: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu.proof", "--dry-run", "--out-dir", str(out),
                           "--work", str(work), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_dry_run_runs_every_stage_and_writes_its_files(tmp_path):
    p = proof(tmp_path / "out", tmp_path / "work", "--deadline", "1200", timeout=1500)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    files = sorted(f.name for f in (tmp_path / "out").iterdir())
    assert len(files) <= 8 and {"results.json", "RESULTS_GPU.md", "log.txt", "env.json", "commands.log"} <= set(files)
    res = json.loads((tmp_path / "out" / "results.json").read_text())["stages"]
    assert [n for n, r in res.items() if r["status"] == "ok"] == list(res), res
    assert set(res) == {"env", "models", "single", "fsdp2", "fsdp1", "load70b", "trl", "fp16", "fsdp2_trace", "syncs",
                        "moe", "moe_speed", "adapters", "preference", "speed", "speed_unsloth",
                        "long_context"}
    single = res["single"]["result"]
    plan = json.loads((tmp_path / "work" / "single" / "memory.json").read_text())["plan"]
    assert plan["steps"] > 0 and plan["load"] > 0  # the planner beside the measured phases
    assert single["trained_tokens_per_s"] > 0 and single["last_loss"] > 0
    assert {"load", "wrap", "steps", "save", "export"} <= set(single["memory"]["phases"])
    for v in (1, 2):
        f = res[f"fsdp{v}"]["result"]
        assert f["resume"]["ok"] and f["resume"]["steps_after_resume"] == [5, 6], f["resume"]
        assert f["eval"]["eval_rows"] > 0 and f["generate"]["ok"]
    check = res["fsdp2"]["result"]["bytecheck"]
    assert check["ok"] and check["weights_checked"] > 0 and check["logits_max_abs_diff"] == 0.0
    assert res["fp16"]["result"]["stopped_line"] and res["fp16"]["result"]["losses_finite"]
    assert res["trl"]["result"]["finetune_over_trl"]["tokens_per_s"] > 0
    for run in ("syncs_single", "syncs_fsdp2"):  # CPU: the run goes through and says it could not count
        sy = res["syncs"]["result"][run]
        assert sy["exit"] == 0 and sy["optimizer_steps"] == 4 and sy["micro_batches_per_step"] == 4, sy
        assert sy["measurable"] is False and sy["syncs_per_optimizer_step"] is None
    moe = res["moe"]["result"]  # 4-bit experts with LoRA on them: trained, planned, evaluated
    assert moe["losses_finite"] and moe["eval"]["eval_rows"] > 0 and moe["plan"]["allocated_gib"] > 0
    speed = res["moe_speed"]["result"]  # grouped at depth, the per-expert loop beside it, each planned
    for run in ("moe_speed", "moe_speed_per_expert"):
        assert speed[run]["losses_finite"] and speed[run]["trained_tokens_per_s"] > 0 and speed[run]["plan"]["allocated_gib"] > 0
    assert speed["grouped_over_per_expert_per_layer"] > 0 and speed["goal"]["met"] is False  # no GPU: not the goal
    ad = res["adapters"]["result"]
    assert ad["adapters_lora"]["losses_finite"] and ad["adapters_dora"]["losses_finite"]
    assert ad["adapters_dora"]["plan"]["allocated_gib"] > ad["adapters_lora"]["plan"]["allocated_gib"]
    assert ad["dora_over_lora"]["tokens_per_s"] > 0
    for method in ("dpo", "orpo"):
        pref = res["preference"]["result"][f"pref_{method}"]
        assert pref["losses_finite"] and 0 <= pref["eval"]["preference_accuracy"] <= 1, pref["eval"]
    sp = res["speed"]["result"]  # our arms beside TRL: the ones this checkout and a CPU can run, run
    today = sp["arms"]["today"]
    assert today["status"] == "ok" and today["trained_tokens_per_s"] > 0 and today["gradients_ok"], today
    assert today["host_s_per_step"] > 0 and today["attention"] == "sdpa" and len(today["losses"]) == 6, today
    assert sp["arms"]["kernels"] == {"status": "skipped", "why": "GPU only: liger's Triton kernels need a CUDA GPU"}
    auto = sp["arms"]["auto"]  # runs once the schema takes `auto`; until then, it says so
    assert (auto["status"] == "ok" and auto["gradients_ok"]) or auto["why"].startswith("setting not available: "), auto
    assert sp["arms"]["compile"]["why"].startswith("not compiled in the dry run")  # minutes of C++ on 2 cores
    assert sp["arms"]["all"]["why"].endswith("(the rest is arm auto)")
    assert sp["over_trl"]["today"]["tokens_per_s"] > 0 and sp["trl"]["grad_norms"]
    assert res["speed_unsloth"]["result"]["why"].startswith("GPU only: unsloth")
    # What the commands printed holds no library warning a user cannot act on (FSDP1's NO_SHARD notice at
    # world size 1 was one: the recipe check says it in its own words).
    lc = res["long_context"]["result"]  # the tiny stand-in trains with the tiled MLP; the 8B's lengths planned
    assert lc["dry"]["ok"] and lc["dry"]["losses_finite"] and lc["dry"]["seq"] == 256, lc["dry"]
    assert lc["planned_8b"]["80gib"]["max_seq_len"] > lc["planned_8b"]["24gib"]["max_seq_len"] > 0
    assert lc["planned_8b"]["24gib"]["limit"].startswith("GPU memory")
    blocks = (tmp_path / "out" / "commands.log").read_text().split("\n$ ")
    ours = [b for b in blocks if " -m finetune " in b.split("\n", 1)[0]]  # not the TRL arm's or a probe's
    assert ours and not [b for b in ours if "UserWarning" in b or "FutureWarning" in b], ours
    md = (tmp_path / "out" / "RESULTS_GPU.md").read_text()
    assert "### adapters_dora" in md and "### pref_dpo" in md and "| today | " in md
    assert "dry run" in md and "## fsdp2" in md and "packed-byte check" in md


def test_a_short_deadline_skips_stages_and_still_writes_the_summary(tmp_path):
    # env (dry-run estimate 15 s) fits in 28 s and runs under a 28 s cap, about twice what it takes on 2 busy
    # cores; what is left after it (a fresh interpreter's imports alone take more than 3 s) is under single's
    # estimate of 25 s, so single is skipped whatever the machine's load
    p = proof(tmp_path / "out", tmp_path / "work", "--stages", "env,single", "--deadline", "28", timeout=400)
    assert p.returncode == 1  # not every stage ran
    res = json.loads((tmp_path / "out" / "results.json").read_text())["stages"]
    assert list(res) == ["env", "single"]
    assert res["single"]["status"] == "skipped" and "left of the deadline" in res["single"]["why"], res["single"]
    assert res["env"]["status"] == "ok", res["env"]
    # every stage says when and at which commit it ran (the results page merges stages of several runs)
    assert all({"date", "commit", "device"} <= set(r) for r in res.values())
    assert "stage     status" in p.stdout and "skipped" in (tmp_path / "out" / "RESULTS_GPU.md").read_text()


def _nan_heavy_checkpoint(dst: Path) -> Path:
    """The tiny Llama with every linear weight rewritten so that its packed NF4 bytes are mostly bf16 NaNs:
    in each 64-value block, every other group of 4 values equals the block's largest magnitude (code 15),
    so those groups pack to 0xFF 0xFF, a bf16 NaN."""
    from safetensors.torch import load_file, save_file

    from finetune.util import builtin

    shutil.copytree(builtin.model_dir(), dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        for k, t in tensors.items():
            if t.dim() == 2 and "proj" in k and t.numel() % 64 == 0:
                blocks = t.float().reshape(-1, 16, 4).clone()  # 64 values = 16 groups of 4
                top = blocks.abs().amax(dim=(1, 2), keepdim=True) + 0.01
                blocks[:, ::2, :] = top.expand(-1, 8, 4)
                tensors[k] = blocks.reshape(t.shape).to(t.dtype)
        save_file(tensors, f, metadata={"format": "pt"})
    return dst


@pytest.mark.distributed
def test_fsdp2_keeps_packed_bytes_bit_for_bit_when_most_read_as_bf16_nans(tmp_path):
    model = _nan_heavy_checkpoint(tmp_path / "model")
    rec = {"model": {"name": str(model), "dtype": "bfloat16", "gradient_checkpointing": False},
           "quantization": {"mode": "nf4"}, "data": {"sources": [{"path": "builtin:tiny-instruct"}], "max_seq_len": 64},
           "distributed": {"strategy": "fsdp", "backend": "gloo", "num_processes": 2},
           "fsdp": {"version": 2},
           "train": {"micro_batch_size": 4, "max_steps": 2, "warmup_steps": 1}, "output": {"dir": str(tmp_path / "run")}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(rec))
    cmd, env = warm_launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                            "-m", "benchmarks.gpu.bytecheck", str(path)])
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    res = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1])
    assert res["world"] == 2 and res["storage"] == "bfloat16"
    assert res["nan_patterns_in_packed"] > 0.2 * res["packed_elements"], res  # the case 1945 is about, in bulk
    assert res["ok"] and res["n_shard_mismatches"] == 0 and res["n_gathered_mismatches"] == 0
    assert res["logits_max_abs_diff"] == 0.0

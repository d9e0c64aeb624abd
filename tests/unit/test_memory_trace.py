"""finetune.train.keepers.memory.peak_sites: the replay of torch's allocator trace that names what is alive at a peak
(the trace itself is recorded only on CUDA; its format is torch's TraceEntry list)."""
from finetune.train.keepers.memory import peak_sites


def frame(file, line, name):
    return {"filename": file, "line": line, "name": name}


def test_the_sites_alive_at_the_peak_are_summed_and_ranked():
    head = [frame("/x/torch/nn/functional.py", 1, "linear"), frame("/w/finetune/train/loss.py", 170, "forward")]
    gather = [frame("/x/torch/_ops.py", 9, "__call__"),
              frame("/v/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", 40, "all_gather")]
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": gather},
        {"action": "alloc", "addr": 2, "size": 50, "frames": head},
        {"action": "alloc", "addr": 3, "size": 30, "frames": head},
        {"action": "free_requested", "addr": 2, "size": 50},  # not yet free: still counted
        {"action": "alloc", "addr": 4, "size": 10, "frames": []},
        {"action": "free_completed", "addr": 2, "size": 50},
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 5, "size": 120, "frames": head},  # 160 live: below the 190 peak
    ]
    out = peak_sites(trace)
    assert out["peak_bytes_traced"] == 190
    sites = {s["site"]: s["bytes"] for s in out["sites"]}
    assert sites == {"torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:40 all_gather [__call__]": 100,
                     "finetune/train/loss.py:170 forward [linear]": 80, "(no library frame) [?]": 10}
    assert [s["bytes"] for s in out["sites"]] == [100, 80, 10]

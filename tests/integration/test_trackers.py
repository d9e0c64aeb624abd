"""`output.report_to`: one tiny run reporting to TensorBoard, W&B (offline) and MLflow (a local file store),
stopped and resumed once; each tracker read back with its own reader and compared with metrics.jsonl."""
import importlib.util
import json
import struct
from pathlib import Path

import pytest

from finetune import recipe as R
from finetune.train.loop import train

pytestmark = pytest.mark.slow

INSTALLED = [n for n, mod in (("tensorboard", "tensorboard"), ("wandb", "wandb"), ("mlflow", "mlflow"))
             if importlib.util.find_spec(mod)]


def _recipe(run_dir: Path, steps: int):
    return R.from_dict({
        "model": {"gradient_checkpointing": False},
        "data": {"eval_sources": [{"path": "builtin:tiny-instruct", "split": "eval"}], "max_seq_len": 64,
                 "max_samples": 64},
        "lora": {"dropout": 0.0},
        "train": {"micro_batch_size": 8, "max_steps": steps, "learning_rate": 3e-3, "log_every": 1, "eval_every": 2},
        "eval": {"max_batches": 1},
        "output": {"dir": str(run_dir), "progress_bar": False, "report_to": INSTALLED},
    })


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    if not INSTALLED:
        pytest.skip("no tracker installed: pip install 'finetune[tensorboard,wandb,mlflow]'")
    root = tmp_path_factory.mktemp("trackers")
    with pytest.MonkeyPatch.context() as mp:
        (root / "wandb").mkdir()
        mp.setenv("WANDB_MODE", "offline")  # never the network
        mp.setenv("WANDB_DIR", str(root / "wandb"))
        mp.setenv("WANDB_SILENT", "true")
        mp.setenv("MLFLOW_TRACKING_URI", f"file:{root / 'mlruns'}")
        mp.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses file stores without it
        run_dir = root / "run"
        train(_recipe(run_dir, 3), run_dir)
        first = json.loads((run_dir / "trackers.json").read_text())
        train(_recipe(run_dir, 5), run_dir)  # max_steps may change on resume: continues from checkpoints/step-3
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return root, run_dir, first, records


def _series(records, key):
    return [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]


def test_tensorboard_scalars_equal_metrics_jsonl(tracked):
    if "tensorboard" not in INSTALLED:
        pytest.skip("tensorboard not installed: pip install 'finetune[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run_dir, _, records = tracked
    acc = EventAccumulator(str(run_dir / "tensorboard" / "finetune"))
    acc.Reload()
    keys = {k for r in records for k in r if k != "step" and isinstance(r[k], (int, float))}
    assert {"loss", "lr", "grad_norm", "eval_loss", "tokens_per_s", "epoch", "time"} <= keys
    # and, at each start's last step, the measured memory per phase (memory.json's; the plan is in the config)
    from finetune.train.keepers.memory import tracker_values

    memory = tracker_values(json.loads((run_dir / "memory.json").read_text()))
    assert "memory/steps_peak_rss_gib" in memory or "memory/steps_peak_allocated_gib" in memory
    assert set(acc.Tags()["scalars"]) == keys | set(memory)
    for key, value in memory.items():
        got = acc.Scalars(key)
        assert [e.step for e in got] == [3, 5] and got[-1].value == pytest.approx(value, rel=1e-6), key
    for key in keys:
        got = [(e.step, e.value) for e in acc.Scalars(key)]
        want = _series(records, key)
        assert [s for s, _ in got] == [s for s, _ in want], key
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6, abs=1e-6), key
    assert max(s for s, _ in _series(records, "loss")) == 5


def _wandb_records(path: Path):
    """The records of a .wandb file: W&B's header, then LevelDB's log format (32 KiB blocks, 7-byte chunk
    headers: crc, length, type 1 full / 2 first / 3 middle / 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, buf = path.read_bytes(), 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4: pos + 7])
        buf += data[pos + 7: pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            yield rec


def test_wandb_offline_resume_appends_to_the_same_run(tracked):
    if "wandb" not in INSTALLED:
        pytest.skip("wandb not installed: pip install 'finetune[wandb]'")
    root, _, first, records = tracked
    wid = first["wandb"]["id"]
    runs = sorted((root / "wandb" / "wandb").glob(f"offline-run-*-{wid}"))
    assert len(runs) == 2 and sorted((root / "wandb" / "wandb").glob("offline-run-*")) == runs  # two starts, one id
    steps = []
    for run in runs:
        for rec in _wandb_records(run / f"run-{wid}.wandb"):
            if rec.WhichOneof("record_type") == "run":
                assert rec.run.run_id == wid
            if rec.WhichOneof("record_type") == "history":
                items = {i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                if "loss" in items:
                    steps.append((rec.history.step.num, items["loss"]))
    want = _series(records, "loss")
    assert [s for s, _ in steps] == [s for s, _ in want] == [1, 2, 3, 4, 5]
    assert [v for _, v in steps] == pytest.approx([v for _, v in want])


def test_mlflow_records_params_and_metrics_in_one_run(tracked):
    if "mlflow" not in INSTALLED:
        pytest.skip("mlflow not installed: pip install 'finetune[mlflow]'")
    import os

    from mlflow.tracking import MlflowClient

    root, run_dir, first, records = tracked
    run_id = first["mlflow"]["run_id"]
    assert json.loads((run_dir / "trackers.json").read_text())["mlflow"]["run_id"] == run_id
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=f"file:{root / 'mlruns'}")
    params = client.get_run(run_id).data.params
    assert params["recipe.train.learning_rate"] == "0.003" and params["recipe.output.report_to"] == json.dumps(INSTALLED)
    assert int(params["data.rows"]) > 0 and int(params["plan.gpu_bytes_per_device"]) > 0
    got, want = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss")), _series(records, "loss")
    assert [s for s, _ in got] == [s for s, _ in want] == [1, 2, 3, 4, 5]  # both starts, one MLflow run
    assert [v for _, v in got] == pytest.approx([v for _, v in want])

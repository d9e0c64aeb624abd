"""Experiment trackers (`output.report_to`) through Accelerate's own: TensorBoard, W&B, MLflow, Trackio.

They see what metrics.jsonl sees (every logged record, at the same step) and, as the run's config, the
resolved recipe, the data stats and the memory plan, flattened to dotted keys and redacted like every other
thing a run writes. Rank 0 only: Accelerate starts and logs trackers on the main process.

A run that resumes from a checkpoint continues the same tracker run: the run ids are kept in
RUN_DIR/trackers.json (W&B: the run id, resumed with resume="allow"; MLflow: the run id), which the run's
Resume reads back (finetune.train.keepers.resume) and hands to `Trackers`. TensorBoard writes
RUN_DIR/tensorboard/<project>/ and purges, on resume, the events after the resumed step (as metrics.jsonl
drops those lines): its `purge_step`. A run that starts from step 0 starts new tracker runs.
"""
from __future__ import annotations

import importlib.util
import json
import os
import uuid
from pathlib import Path

from finetune.util import atomic
from finetune.util.errors import Problem
from finetune.util.log import log
from finetune.util.redact import redact_obj

# report_to name -> (module that must be importable, pip extra of finetune that installs it)
TRACKERS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
            "mlflow": ("mlflow", "mlflow"), "trackio": ("trackio", "trackio")}
STATE = "trackers.json"
PROJECT = "finetune"  # W&B project, MLflow experiment (MLFLOW_EXPERIMENT_NAME overrides), TensorBoard subdir


def tracker_problems(report_to, env=None) -> list[Problem]:
    """Each tracker named in output.report_to that is not installed here, with the extra that installs it, or
    that cannot work here (`usable_problem`): found by the preflight, before any weights load."""
    env = os.environ if env is None else env
    out = []
    for name in report_to:
        module, extra = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            out.append(Problem(level="error", path="output.report_to",
                               message=f"{name} is not installed (module {module!r} not found)",
                               fix=f"pip install 'finetune[{extra}]', or remove {name} from output.report_to"))
        elif why := usable_problem(name, env):
            out.append(Problem(level="error", path="output.report_to", message=why[0], fix=why[1]))
    return out


# A tracker that cannot work is an error of the preflight (exit 2, before any weights load), not a run that
# continues without it: a run the user asked to track and that was not tracked is found out only afterwards.
# The offline modes need nothing and pass.
def usable_problem(name: str, env) -> tuple[str, str] | None:
    """(why, fix) when W&B has no login to use (online mode) or a configured W&B or MLflow server does not
    answer on its port; None otherwise, and for the offline modes (WANDB_MODE=offline, an MLflow file or
    database store). Never reaches beyond a configured server: the default W&B cloud is not probed."""
    if name == "wandb" and env.get("WANDB_MODE", "online") not in ("offline", "disabled", "dryrun"):
        base = env.get("WANDB_BASE_URL", "https://api.wandb.ai")
        fix = ("run `wandb login` (or set WANDB_API_KEY), or set WANDB_MODE=offline to log locally and `wandb sync` "
               "later, or remove wandb from output.report_to")
        if not env.get("WANDB_API_KEY") and not _netrc_has(_host(base), env):
            return f"wandb is not logged in here (no WANDB_API_KEY, no {_host(base)} entry in the netrc file)", fix
        if "WANDB_BASE_URL" in env and (why := unreachable(base)):
            return f"the W&B server WANDB_BASE_URL={base} {why}", fix
    if name == "mlflow":
        uri = env.get("MLFLOW_TRACKING_URI", "")
        if uri.startswith(("http://", "https://")) and (why := unreachable(uri)):
            return (f"the MLflow tracking server MLFLOW_TRACKING_URI={uri} {why}",
                    "start the server or correct MLFLOW_TRACKING_URI, or point it at a local store "
                    "(sqlite:///mlflow.db), or remove mlflow from output.report_to")
    return None


def _host(url: str) -> str:
    from urllib.parse import urlsplit

    return urlsplit(url).hostname or url


def _netrc_has(host: str, env) -> bool:
    import netrc

    path = env.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def unreachable(url: str, timeout: float = 3.0) -> str | None:
    """Why nothing answers at `url`'s host and port (a TCP connect, nothing sent), or None."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname or "", port), timeout=timeout):
            return None
    except OSError as e:
        return f"does not answer ({e.strerror or type(e).__name__} connecting to {parts.hostname}:{port})"


def accelerator_kwargs(report_to, run_dir: Path) -> dict:
    """What Accelerator() needs for the trackers: log_with and the directory TensorBoard writes under."""
    if not report_to:
        return {}
    from accelerate.utils import ProjectConfiguration

    return {"log_with": list(report_to),
            "project_config": ProjectConfiguration(project_dir=str(run_dir), logging_dir=str(run_dir / "tensorboard"))}


def read_state(run_dir: Path) -> dict:
    try:
        state = json.loads((Path(run_dir) / STATE).read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def init_kwargs(report_to, run_dir: Path, state: dict, step: int) -> dict:
    """Per-tracker arguments: the kept run ids when `state` has them (a resumed run), else new ones."""
    kw = {}
    if "tensorboard" in report_to:
        # Events past the resumed step are dropped, as metrics.jsonl drops their lines; a crash loses <= 30 s.
        kw["tensorboard"] = {"purge_step": step + 1, "flush_secs": 30}
    if "wandb" in report_to:
        wid = state.get("wandb", {}).get("id") or uuid.uuid4().hex[:12]
        kw["wandb"] = {"id": wid, "resume": "allow", "name": Path(run_dir).name}
        if not os.environ.get("WANDB_DIR"):
            kw["wandb"]["dir"] = str(run_dir)  # RUN_DIR/wandb, not the current directory
    if "mlflow" in report_to:
        kw["mlflow"] = {"run_id": state.get("mlflow", {}).get("run_id"), "run_name": Path(run_dir).name}
    return kw


def flat_config(tree: dict, prefix: str = "") -> dict:
    """Nested config -> {"a.b": scalar}: every tracker takes str/int/float/bool values; lists, None and
    other values are stored as JSON text."""
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat_config(v, key + "."))
        elif isinstance(v, (str, int, float, bool)):
            out[key] = v
        else:
            out[key] = json.dumps(v, default=str)
    return out


def run_config(recipe, stats: dict) -> dict:
    """The resolved recipe, the data stats and the memory plan (when the planner knows the model)."""
    from finetune.plan.estimate import build, from_recipe

    config = {"recipe": recipe.to_yaml_dict(), "data": stats}
    try:
        config["plan"] = {k: v for k, v in build(from_recipe(recipe)).to_json().items() if k != "setup"}
    except (ValueError, OSError) as e:  # an unknown architecture: the run trains, the config says why no plan
        config["plan"] = {"unavailable": str(e)}
    return flat_config(redact_obj(config))


class Trackers:
    """The run's trackers on an Accelerator built with `accelerator_kwargs`; every method is a no-op
    when output.report_to is empty."""

    def __init__(self, acc, recipe, run_dir: Path, stats: dict, step: int, kept_ids: dict | None):
        """`kept_ids`: the run ids a resumed run kept (RUN_DIR/trackers.json, read by its Resume:
        finetune.train.keepers.resume); None for a run from step 0, which is a new tracker run."""
        self.acc, self.names = acc, list(recipe.output.report_to)
        if not self.names:
            return
        resumed, state = kept_ids is not None, kept_ids or {}
        kw = init_kwargs(self.names, run_dir, state, step)
        acc.init_trackers(PROJECT, config=None, init_kwargs=kw)
        if not acc.is_main_process:
            return
        self._store_config(run_config(recipe, stats), resumed)
        ids = {}
        if "wandb" in self.names:
            ids["wandb"] = {"id": kw["wandb"]["id"]}
        if "mlflow" in self.names:
            ids["mlflow"] = {"run_id": acc.get_tracker("mlflow", unwrap=True).info.run_id}
        atomic.write_text(Path(run_dir) / STATE, json.dumps(ids, indent=1) + "\n")
        log.info(f"trackers: {', '.join(self.names)}" + (" (continuing their runs)" if state else ""))

    def _store_config(self, config: dict, resumed: bool):
        for tracker in self.acc.trackers:
            try:
                tracker.store_init_configuration(config)
            except Exception as e:  # noqa: BLE001 - MLflow refuses a changed param (train.max_steps raised on resume)
                if not resumed:
                    raise
                log.warning(f"trackers: {tracker.name} keeps the config of the run's first start ({e})")

    def log(self, step: int, record: dict):
        """One metrics.jsonl record at its step: every numeric value (None, e.g. no grad norm, is left out)."""
        if not self.names:
            return
        values = {k: v for k, v in record.items()
                  if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        self.acc.log(values, step=step)

    def finish(self):
        if self.names:
            self.acc.end_training()
            self.names = []

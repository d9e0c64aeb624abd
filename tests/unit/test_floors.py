"""Every dependency floor in pyproject is a version the code has run on (benchmarks/gpu/floors.py)."""
from packaging.version import Version

from benchmarks.gpu import floors


def test_every_floor_is_a_pinned_or_recorded_version():
    pins, ran = floors.pins(), floors.RAN_ON
    bad = []
    for pkg, floor in floors.floors().items():
        ok = [Version(pins[pkg])] if pkg in pins else []
        ok += [Version(ran[pkg][0])] if pkg in ran else []
        if Version(floor) not in ok:
            bad.append(f"{pkg}>={floor}: runs are recorded on {[str(v) for v in ok] or 'no version'}")
    assert not bad, bad


def test_the_installed_versions_meet_every_floor():
    failing = {k: v for k, v in floors.check_floors().items() if not v["ok"]}
    assert not failing, failing


def test_transformers_floor_covers_what_the_code_calls():
    # finetune.train.lora.enable_checkpointing calls activation_checkpointing_enable, new in transformers 5.23
    assert Version(floors.floors()["transformers"]) >= Version("5.23")

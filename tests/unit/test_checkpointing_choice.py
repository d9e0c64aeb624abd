"""model.gradient_checkpointing: auto | true | false | N, the planner only (no weights load): `validate` and
`estimate` show the planner's choice in the words training logs, the choice is the fewest checkpointed layers
whose planned peak fits, the partial layout's activation terms sit between none and all, and bad values exit 2
with the field named."""
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from finetune import cli
from finetune import recipe as R
from finetune.plan import checkpointing as C
from finetune.plan import estimate as E
from finetune.plan.archs import resolve

ROOT = Path(__file__).resolve().parents[2]
R8 = str(ROOT / "recipes" / "llama3_8b_qlora.yaml")
R70 = str(ROOT / "recipes" / "llama3_70b_qlora.yaml")
TINY = str(ROOT / "recipes" / "tiny_cpu.yaml")
GiB = 2**30
LINE = re.compile(r"^gradient checkpointing: auto -> (\d+) of (\d+) layers \(plan ([\d.]+) of ([\d.]+) GiB(;.*)?\)$",
                  re.M)


def planner_choice(path: str, gib: int, gpus: int | None = None) -> tuple[int, int]:
    """The planner alone: the fewest checkpointed layers whose plan fits, found by trying every count."""
    r = R.load(path, ["model.gradient_checkpointing=auto"])
    s = replace(E.from_recipe(r), gpu_memory=gib * GiB)
    if gpus:
        s = replace(s, gpus=gpus, strategy="fsdp" if gpus > 1 and s.strategy == "single" else s.strategy)
    arch, _ = resolve(s.model)
    fits = [k for k in range(arch.layers + 1)
            if E.build(replace(s, checkpointing=k), arch, "").gpu_bytes_per_device <= gib * GiB]
    return (fits[0] if fits else arch.layers), arch.layers


@pytest.mark.parametrize("path,gib,gpus,expect", [
    (R8, 80, None, lambda k, n: k == 0),  # an 80 GiB GPU holds every activation of 2 x 2048
    (R8, 24, None, lambda k, n: 0 < k < n),  # 24 GiB: some layers recompute, not all
    (R70, 24, 2, lambda k, n: 0 < k < n),  # 70B on 2 x 24 GiB (FSDP2 with CPU offload)
])
def test_validate_and_estimate_show_the_planners_choice(capsys, path, gib, gpus, expect):
    more = ["--gpus", str(gpus)] if gpus else []
    assert cli.main(["estimate", path, "--gpu-memory", f"{gib}GiB", *more, "model.gradient_checkpointing=auto",
                     "--json"]) == 0
    out = capsys.readouterr().out
    (est,) = LINE.findall(out)
    ck = json.loads(out.strip().splitlines()[-1])["checkpointing"]
    assert cli.main(["validate", path, "--gpu-memory", f"{gib}GiB", *more, "model.gradient_checkpointing=auto"]) == 0
    (val,) = LINE.findall(capsys.readouterr().out)
    assert val == est  # the same words, the same figures
    k, n = planner_choice(path, gib, gpus)
    assert (int(est[0]), int(est[1])) == (ck["layers"], ck["of"]) == (k, n) and expect(k, n)
    assert float(est[2]) <= float(est[3]) == gib  # planned within the GPU
    assert ("fewer FLOPs a step" in est[4]) == (k < n) and 0 <= ck["flops_saved"] < 0.35


def test_max_memory_gib_caps_what_auto_plans_against(capsys):
    assert cli.main(["validate", R8, "--gpu-memory", "80GiB", "model.gradient_checkpointing=auto",
                     "model.max_memory_gib=24"]) == 0
    capped = LINE.findall(capsys.readouterr().out)[0]
    assert (int(capped[0]), float(capped[3])) == (planner_choice(R8, 24)[0], 24.0)


def test_partial_layout_plans_between_none_and_all():
    r = R.load(R8)
    s = replace(E.from_recipe(r), gpu_memory=None)
    arch, _ = resolve(s.model)
    peaks = [E.build(replace(s, checkpointing=k), arch, "").gpu_bytes_per_device for k in range(arch.layers + 1)]
    assert peaks[0] == E.build(replace(s, checkpointing=False), arch, "").gpu_bytes_per_device
    assert peaks[-1] == E.build(replace(s, checkpointing=True), arch, "").gpu_bytes_per_device
    assert all(a >= b for a, b in zip(peaks, peaks[1:])) and peaks[0] > peaks[arch.layers // 2] > peaks[-1]
    # each layer checkpointed trades what it saves for its input (the first ones: their inputs are held)
    step = peaks[10] - peaks[11]
    assert 0.3 * GiB < step < 0.7 * GiB, step


def test_auto_without_memory_plans_every_layer_and_says_why():
    s = E.from_recipe(R.load(R8, ["model.gradient_checkpointing=auto"]))
    p, choice = C.fit(s)
    assert choice.layers == choice.total == 32 and "give --gpu-memory or model.max_memory_gib" in choice.line()


@pytest.mark.parametrize("value,words", [("-1", "from 0 to 1024"), ("half", "true, false, auto"),
                                         ("2.5", "a number of decoder layers"), ("5", "has 4 decoder layers")])
def test_bad_values_exit_2_naming_the_field(capsys, value, words):
    assert cli.main(["validate", TINY, f"model.gradient_checkpointing={value}"]) == 2
    cap = capsys.readouterr()
    out = cap.out + cap.err
    assert "model.gradient_checkpointing" in out and words in out and "Traceback" not in out


def test_activation_offloading_needs_every_layer_checkpointed(capsys):
    assert cli.main(["validate", R8, "model.activation_offloading=true", "model.gradient_checkpointing=auto"]) == 2
    cap = capsys.readouterr()
    assert "model.activation_offloading" in cap.out + cap.err and "would send every activation" in cap.out + cap.err

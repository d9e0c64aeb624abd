"""Every numeric argument of `generate` is range-checked and generation is bounded by the model's context:
exit 2 with one line naming the argument, never a traceback and never a run that goes on for hours."""
import pytest

from ..conftest import run_cli

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("args,needle", [
    (["--max-new-tokens", "-5"], "--max-new-tokens must be at least 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--max-new-tokens", str(10 ** 12)], "more than the model's context"),
    (["--seed", "-1"], "--seed must be 0 to 2^32-1"),
    (["--seed", str(2 ** 64)], "--seed must be 0 to 2^32-1"),
    (["--temperature", "nan"], "--temperature must be a finite number"),
    (["--temperature", "inf"], "--temperature must be a finite number"),
    (["--top-p", "nan", "--temperature", "1"], "--top-p must be in (0, 1]"),
], ids=["mnt-neg", "mnt-0", "mnt-1e12", "seed-neg", "seed-2^64", "temp-nan", "temp-inf", "top-p-nan"])
def test_out_of_range_arguments_are_refused(tiny_run, args, needle):
    p = run_cli(["generate", str(tiny_run), "--prompt", "hi", *args], timeout=300)
    assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]


@pytest.mark.parametrize("prompt,needle", [("", "--prompt #1 is empty"), ("  ", "--prompt #1 is empty"),
                                           ("word " * 5000, "--prompt: the longest prompt has")])
def test_empty_and_overlong_prompts_are_refused(tiny_run, prompt, needle):
    p = run_cli(["generate", str(tiny_run), "--prompt", prompt], timeout=300)
    assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]

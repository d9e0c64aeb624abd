"""Every `python -m benchmarks...` command the documentation shows runs: README.md, benchmarks/README.md and
docs/*.md are read for them, and each distinct module answers `--help` with exit 0 (commands moved
with the benchmarks/ layout, and a page that names a module gone stale is what this catches)."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"python3? -m (benchmarks(?:\.\w+)*)")


def documented_modules() -> dict[str, list[str]]:
    """module -> the pages that show a command running it."""
    found: dict[str, list[str]] = {}
    for page in PAGES:
        for module in COMMAND.findall(page.read_text(encoding="utf-8")):
            found.setdefault(module, []).append(str(page.relative_to(ROOT)))
    return found


def test_benchmarks_has_a_readme_with_one_table():
    text = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    assert "| row | command | what it measures | goal | result goes to |" in text
    assert text.count("| row | command |") == 1


def test_every_documented_benchmark_command_answers_help():
    modules = documented_modules()
    # the pages this test exists for: the CPU rows, the proof under its cited name, and a moved module
    assert {"benchmarks", "benchmarks.gpu_proof", "benchmarks.cpu.phase_rss"} <= set(modules), modules
    # All at once: each is a fresh interpreter, and --help answers before any heavy import.
    procs = {m: subprocess.Popen([sys.executable, "-m", m, "--help"], cwd=ROOT, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for m in sorted(modules)}
    failed = {}
    for module, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        if proc.returncode != 0 or "usage:" not in out:
            failed[module] = f"exit {proc.returncode}, shown in {modules[module]}: {err.strip()[-300:]}"
    assert failed == {}

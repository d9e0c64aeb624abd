from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def commands():
    text = (ROOT / "README.md").read_text()
    blocks = text.split("```bash")[1:3]
    return [next(l for l in b.splitlines() if l and not l.startswith("#") and l.strip()) for b in blocks]


def test_readme_starts_with_the_two_commands():
    run, test = commands()
    assert "recipes/tiny_cpu.yaml" in run and "scripts/setup.sh" in run
    assert "pytest" in test and "scripts/setup.sh" in test


def test_ci_runs_the_readme_test_command_verbatim():
    assert commands()[1] in (ROOT / ".ci" / "run").read_text()

"""Comments, docstrings and docs cite files and modules that exist: a path to a .py file (from the repository
root, from finetune/, from the citing file's folder, or the tail of a path in the repository) and a dotted
`finetune.x.y` name (a module, or a name a module defines). A move that leaves a citation behind fails here,
and so does a citation of an issue number, which the repository does not hold (say what the change did)."""
import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("finetune", "benchmarks", "tests", "scripts")
PY_PATH = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.py)\b")
DOTTED = re.compile(r"\bfinetune(?:\.[A-Za-z_]\w*)+")
ISSUE = re.compile(r"(?:\b(\w+) )?\b([Ii]ssues? \d+)")
LIBRARIES = ("bitsandbytes", "torch", "transformers", "peft", "accelerate", "trl", "datasets", "llama.cpp")
# Files of other projects that comments cite (llama.cpp's converters, library sources) and names that are not
# modules (the sbatch file `finetune slurm` writes; a module that once existed, cited as gone; placeholders).
EXTERNAL_FILES = ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py", "conversion_mapping.py")
EXTERNAL_TREES = ("torch/", "torchao/", "accelerate/", "peft/", "tuners/", "utils/launch.py", "conversion/")
NOT_MODULES = ("finetune.sbatch", "finetune.validate", "finetune.x")


def repo_files() -> list[Path]:
    return [p for d in SCANNED for p in (ROOT / d).rglob("*.py") if ".venv" not in p.parts]


def prose_of_python(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python file."""
    text = path.read_text()
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(text).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out.append((node.body[0].lineno, doc))
    return out


def prose_of_docs() -> list[tuple[Path, int, str]]:
    docs = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "benchmarks").rglob("README.md")]
    return [(p, i, line) for p in docs if p.exists() for i, line in enumerate(p.read_text().splitlines(), 1)]


def path_exists(cited: str, where: Path, tails: set[str]) -> bool:
    if cited in EXTERNAL_FILES or cited.startswith(EXTERNAL_TREES):
        return True
    return any((base / cited).exists() for base in (ROOT, ROOT / "finetune", where.parent)) or cited in tails


def dotted_exists(name: str) -> bool:
    if name.startswith(NOT_MODULES):
        return True
    parts = name.split(".")
    for n in range(len(parts), 1, -1):
        base = ROOT.joinpath(*parts[:n])
        module = base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"
        if module.exists():
            rest = parts[n:]
            return not rest or re.search(rf"^\s*(def|class)\s+{re.escape(rest[0])}\b|^\s*{re.escape(rest[0])}\s*[:=]",
                                         module.read_text(), re.M) is not None
    return False


def stale_citations() -> list[str]:
    files = repo_files()
    tails = {"/".join(p.relative_to(ROOT).parts[-k:]) for p in files for k in range(1, len(p.parts))}
    prose = [(p, line, text) for p in files for line, text in prose_of_python(p)] + prose_of_docs()
    found = []
    for path, line, text in prose:
        where = f"{path.relative_to(ROOT)}:{line}"
        found += [f"{where}: {c}" for c in PY_PATH.findall(text) if not path_exists(c, path, tails)]
        found += [f"{where}: {c}" for c in DOTTED.findall(text) if not dotted_exists(c.rstrip("."))]
        if path.suffix == ".py":
            found += [f"{where}: {c}" for lib, c in ISSUE.findall(text) if lib not in LIBRARIES]  # theirs: cited
    return found


def test_comments_and_docs_cite_what_exists():
    assert stale_citations() == []


def test_the_check_sees_a_stale_citation(tmp_path, monkeypatch):
    assert path_exists("weights/heap.py", ROOT / "finetune" / "x.py", set())
    assert not path_exists("weights/device.py", ROOT / "finetune" / "x.py", set())
    assert dotted_exists("finetune.weights.heap.release_cached_memory") and dotted_exists("finetune.train")
    assert not dotted_exists("finetune.weights.device") and not dotted_exists("finetune.weights.heap.no_such_name")
    probe = tmp_path / "probe.py"
    probe.write_text('"""See weights/device.py (issue 12)."""\n# finetune.weights.device.to_device\nx = "a.py"\n')
    texts = " ".join(t for _, t in prose_of_python(probe))
    assert PY_PATH.findall(texts) == ["weights/device.py"] and ISSUE.findall(texts) == [("", "issue 12")]
    assert DOTTED.findall(texts) == ["finetune.weights.device.to_device"]

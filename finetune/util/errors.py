"""The errors every layer may raise, and how an entry point turns them into exit codes.

Exit codes: 0 ok, 2 bad input (recipe, data, arguments: `RecipeError`, rendered without a traceback),
3 a run that cannot go on although its input is valid (`RunError`: training diverged, the output dir is
in use by another run, a GPU is installed but unusable, the export's quantizer is missing; also rendered
without a traceback, and not a RecipeError), 1 anything else
(`OutputWriteError` is rendered as one line: what failed and what was kept), 130 when interrupted. `exit_code` applies them to an entry function (the CLI's dispatch).
"""
from __future__ import annotations

import errno
import sys
from typing import Callable, Literal

from pydantic import BaseModel


class ProblemsError(Exception):
    """What RecipeError and RunError share: a list of `problems` (with an optional `source`, a `total` when
    only the first few are listed, and `notes` after the list) that an entry point prints without a
    traceback. Neither is the other: `except RecipeError` never catches a RunError, so bad input (2) and a
    run that cannot go on (3) are told apart wherever they are caught."""

    def __init__(self, problems: list[str], source: str | None = None, total: int | None = None,
                 notes: tuple[str, ...] = ()):
        # `total`: how many problems there are when `problems` lists only the first few; `notes`: lines
        # that follow the list (a fix, a setting) and are not problems, so the count never includes them.
        self.problems = list(problems)
        self.source, self.total, self.notes = source, max(total or 0, len(self.problems)), tuple(notes)
        head = f"{source}: " if source else ""
        super().__init__(head + "; ".join(self.problems + list(self.notes)))


class RecipeError(ProblemsError):
    """Bad input (recipe, overrides, data or arguments). The CLI prints `problems` and exits 2."""

    def render(self) -> str:
        where = f"{self.source}: " if self.source else ""
        n, shown = self.total, len(self.problems)
        lines = [f"error: {where}{n} problem{'s' if n != 1 else ''} in the recipe" if self.source
                 else f"error: {n} problem{'s' if n != 1 else ''}" + (f" (the first {shown} shown)" if n > shown else "")]
        lines += [f"  - {p}" for p in self.problems]
        lines += [f"  ... and {n - shown} more"] if n > shown else []
        lines += [f"  {note}" for note in self.notes]
        return "\n".join(lines)


class RunError(ProblemsError):
    """The input is valid but the run cannot go on (diverged, output dir in use, GPU unusable, the export's
    quantizer missing): exit 3, so a scheduler can tell it from bad input (2, fix the recipe) and from a
    crash (1). Not a RecipeError: a handler of bad input does not swallow it."""

    def render(self) -> str:
        n = len(self.problems)
        return "\n".join([f"error: the run stopped ({n} problem{'s' if n != 1 else ''})"] + [f"  - {p}" for p in self.problems])


class Problem(BaseModel):
    """One finding of a check (contract, preflight, launcher): an error stops the run, a warning is shown."""

    level: Literal["error", "warning"]
    path: str
    message: str
    fix: str = ""

    def render(self) -> str:
        fix = f" Fix: {self.fix}" if self.fix else ""
        return f"{self.path}: {self.message}.{fix}"


class OutputWriteError(OSError):
    """Writing the run's output failed (disk full, quota, read-only, permission). Nothing that looks
    complete was left behind; the message says what happened and where."""


REASONS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
           errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
           errno.EPERM: "operation not permitted", errno.EFBIG: "the file size limit was reached"}


def reason(e: OSError) -> str:
    return REASONS.get(e.errno, e.strerror or str(e))


def explain(e: OSError, what: str, path) -> OutputWriteError:
    return OutputWriteError(e.errno, f"{what} failed: {reason(e)} ({path}); nothing partial was kept, the "
                                     "previous checkpoint is intact. Free space (or fix the output dir) and re-run "
                                     "the same command to resume")


def exit_code(main: Callable[[list[str]], int | None], argv: list[str]) -> int:
    """Run an entry function and map what it raises to the exit codes above."""
    try:
        return int(main(argv) or 0)
    except RunError as e:
        print(e.render(), file=sys.stderr)
        return 3
    except RecipeError as e:
        print(e.render(), file=sys.stderr)
        return 2
    except OutputWriteError as e:  # disk full or unwritable mid-run: the message says what was kept
        print(f"error: {e.strerror}", file=sys.stderr)
        return 1
    except OSError as e:  # any verb: a missing, read-only or wrong-type path, a full disk: one line, not a traceback
        where = f": {e.filename}" + (f" -> {e.filename2}" if e.filename2 else "") if e.filename else ""
        print(f"error: {reason(e)}{where}; nothing was replaced (check the path, its permissions and free space)",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C twice, or a stop signal before training started
        print(f"interrupted ({e})" if str(e) else "interrupted", file=sys.stderr)
        return 130

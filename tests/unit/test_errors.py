"""finetune.util.errors: bad input (RecipeError) and a run that cannot go on (RunError) are different
exceptions with different exit codes; a handler of one never takes the other."""
import pytest

from finetune.util.errors import RecipeError, RunError, exit_code


def raising(error):
    def main(argv):
        raise error
    return main


def test_exit_code_maps_run_errors_to_3_and_bad_input_to_2(capsys):
    assert exit_code(raising(RunError(["training diverged at step 1"])), []) == 3
    assert "error: the run stopped (1 problem)" in capsys.readouterr().err
    assert exit_code(raising(RecipeError(["train.max_steps: must be > 0"], "r.yaml")), []) == 2
    assert "error: r.yaml: 1 problem in the recipe" in capsys.readouterr().err
    assert exit_code(lambda argv: None, []) == 0


def test_a_run_error_is_not_bad_input():
    assert not issubclass(RunError, RecipeError) and not issubclass(RecipeError, RunError)
    with pytest.raises(RunError):  # an `except RecipeError` lets it through
        try:
            raise RunError(["output.dir: /r is in use by another run"])
        except RecipeError:
            pytest.fail("except RecipeError caught a RunError")
    e = RunError(["a", "b"], "r.yaml")  # the shared part: the problems and the message
    assert e.problems == ["a", "b"] and str(e) == "r.yaml: a; b"

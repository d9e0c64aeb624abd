"""Layer `recipe`: the schema of a run, loading a recipe file with key=value overrides, the cross-field
contract, and the resolved recipe a run dir keeps. Torch-free. read.py reads a recipe file (`load`).

The public names are importable from the package itself (`from finetune.recipe import load, Recipe`).
"""
from finetune.recipe.contract import contract_problems
from finetune.recipe.read import apply_overrides, field_docs, from_dict, load, parse_override, read_yaml
from finetune.recipe.schema import (DataFormat, DataSource, DataSpec, DistributedSpec, DType, EvalSpec, FsdpSpec,
                                    LoraSpec, ModelSpec, OutputSpec, QuantizationSpec, Recipe, TrainSpec)
from finetune.util.errors import Problem, RecipeError

__all__ = ["contract_problems", "apply_overrides", "field_docs", "from_dict", "load", "parse_override", "read_yaml",
           "DataFormat", "DataSource", "DataSpec", "DistributedSpec", "DType", "EvalSpec", "FsdpSpec", "LoraSpec",
           "ModelSpec", "OutputSpec", "QuantizationSpec", "Recipe", "TrainSpec", "Problem", "RecipeError"]

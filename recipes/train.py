"""Fine-tune a causal LM with a sits_lora adapter.

    accelerate launch --quiet recipes/train.py              # SmolLM2-135M on the stdlib docs, 5-11 min on a 2-core CPU
    accelerate launch --quiet recipes/train.py --config recipes/configs/default.yaml --max-steps 20
    python recipes/train.py --model path/to/model_or.gguf --dataset my.jsonl --r 8

Flags override the YAML config, which overrides the defaults (sits_lora.recipe.train.TrainRecipe). A bad input
stops in one line with exit status 2 (under `accelerate launch`, `--quiet` keeps accelerate from adding its
own traceback of the failed process, and the status becomes 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import yaml

from sits_lora.recipe.train import true_or_false   # torch loads later, after the options are checked


def _parser(fields) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML file with any of the options below (recipes/configs/*.yaml)")
    for f in fields:
        flag = "--" + f.name.replace("_", "-")
        kind = {bool: true_or_false, int: int, float: float}.get(type(f.default), str)
        parser.add_argument(flag, dest=f.name, type=kind, default=None, help=f.metadata.get("help"))
    return parser


def main(argv=None) -> int:
    from sits_lora.recipe.data import DatasetTooSmallError
    from sits_lora.recipe.loading import ModelNotFoundError, require_reachable, resolve_model_source
    from sits_lora.recipe.train import ModelChoiceError, TrainRecipe, run

    fields = dataclasses.fields(TrainRecipe)
    args = _parser(fields).parse_args(argv)
    try:
        values = {}
        if args.config:
            if not os.path.isfile(args.config):
                raise FileNotFoundError(f"--config {args.config}: no such file")
            values = yaml.safe_load(open(args.config)) or {}
            unknown = sorted(set(values) - set(TrainRecipe.field_names()))
            if unknown:
                raise ValueError(f"--config {args.config}: unknown keys {unknown}; allowed: {TrainRecipe.field_names()}")
        values.update({f.name: getattr(args, f.name) for f in fields if getattr(args, f.name) is not None})
        recipe = TrainRecipe(**values)
        require_reachable(resolve_model_source(recipe.model))  # fail now, in one line, not after minutes of loading
        recipe.check_inputs()
    except (ModelNotFoundError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        run(recipe)
    except DatasetTooSmallError as error:  # found after the tokenizer loaded: still the user's input, one line
        print(f"error: --dataset {recipe.dataset or '(default corpus)'}: {error}", file=sys.stderr)
        return 2
    except ModelChoiceError as error:  # an option that does not fit the model, found once it loaded
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The recipe with --base-quant nf4 on this CPU (a one-off quality study): the recipe refuses nf4 without CUDA, and
bitsandbytes' CPU eval forward repacks 4-bit weights on a CPU with AVX512-BF16; both are switched off here."""
import os
import sys

import bitsandbytes.nn.modules as bnb_modules

bnb_modules.has_avx512bf16 = lambda: False           # no eval-mode repacking of the 4-bit weights
from sits_lora.recipe import train as recipe_train  # noqa: E402

recipe_train.TrainRecipe.check_machine = lambda self: None
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "recipes"))
import train as recipe_cli  # noqa: E402

sys.exit(recipe_cli.main(sys.argv[1:]))

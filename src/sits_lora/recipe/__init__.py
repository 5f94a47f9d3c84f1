"""The training recipe behind ``accelerate launch recipes/train.py``: its options and run (``train``), the
offline text data (``data``) and the model loading, GGUF included (``loading``).

Option checks answer before torch loads, so a bad flag costs no import time; import the submodules
directly (``from sits_lora.recipe.train import TrainRecipe``).
"""

"""DreamBooth-style LoRA fine-tune of a diffusers U-Net with a sits_lora adapter, fully offline.

    python recipes/train_diffusion.py                                 # tiny random model, 32 px: 22 s on a 2-core CPU
    python recipes/train_diffusion.py --model sd15 --batch-size 4     # the SD1.5 U-Net's shapes: a CUDA GPU only
    python recipes/train_diffusion.py --model sdxl --adapter peft     # PEFT's LoRA on the SDXL U-Net, to compare
    python recipes/train_diffusion.py --model sd15 --cuda-graphs      # the whole step replayed as a CUDA graph

Nothing is downloaded. The images are drawn here: a circle, square or triangle in red, green, blue or yellow on a
plain background, captioned "a photo of sks red circle"; the same images for the same --seed. The models are built
from configs with random weights (the seed's too): `tiny` (a 2-block U-Net, a 4-block VAE, a 2-layer CLIP text
encoder, a CLIP tokenizer over the captions' words; for the CPU and CI), `sd15` and `sdxl` (the real U-Nets' shapes,
860 M and 2.6 B parameters, and the SD VAE's; text encoders of the real widths with 2 layers each: for measuring
speed and memory on a CUDA GPU, not for pictures; refused without one, a step takes minutes on a CPU).

The VAE encodes the images once (their latent mean and std are cached, a latent is sampled from them at each step)
and the text encoder the captions once; the loop trains the U-Net's LoRA on to_q, to_k, to_v and to_out.0 on the
noise-prediction MSE (DDPM noise schedule of Stable Diffusion), AdamW at a constant learning rate, gradients clipped
to norm 1, bf16 autocast on CUDA and fp32 on the CPU. Every step checks its loss and gradients: one that is not
finite stops the run, naming the step, with exit status 1 (the last checkpoint stays, --resume continues from it).
--cuda-graphs (a GPU only) records the step after two eager ones and replays it: the host's time leaves the step
(docs/usage.md has the measurement); a non-finite step is then skipped on the GPU and stops the run as above.

--output-dir gets metrics.jsonl (a line per step: step, loss, seconds that step took), summary.json, loss.png,
lora/ (sits_lora.export_diffusers_lora: the file `pipe.load_lora_weights("lora")` reads) and checkpoint-N/ folders
(the last two). For the tiny model also base/ (the random base pipeline, StableDiffusionPipeline.from_pretrained
loads it) and a check that lora/ loads with load_lora_weights and gives the trained U-Net's outputs. Ctrl-C finishes
the step, saves lora/ and a checkpoint, and exits with status 130 (a second Ctrl-C stops at once); --resume true
continues from the latest checkpoint. A bad option stops in one line with exit status 2, before any model is built.
"""

import sys

from sits_lora.recipe.diffusion import main

if __name__ == "__main__":
    sys.exit(main())

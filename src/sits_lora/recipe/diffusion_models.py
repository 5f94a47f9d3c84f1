"""The diffusion recipe's data and models: the drawn shapes and their captions, the tiny / SD1.5 / SDXL-shaped
components built from configurations (random weights, offline), the LoRA attached, and the data as the frozen
encoders give it once (latents' mean and std, text states) with each step's batch drawn from it. torch, diffusers and
transformers load inside the functions (the recipe checks its options first)."""

from __future__ import annotations

import random
from dataclasses import dataclass

ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]
TEXT_TOKENS = {"tiny": 16, "sd15": 77, "sdxl": 77}
SHAPES = ("circle", "square", "triangle")
COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 200, 30)}
BACKGROUNDS = ((245, 245, 245), (128, 128, 128), (20, 20, 20))
INSTANCE_PROMPT = "a photo of sks"


# ---------------------------------------------------------------------------------------------------- data

def draw_shapes(num_images: int, size: int, seed: int):
    """``num_images`` pictures of one shape each, (N, 3, size, size) float32 in [-1, 1], and their captions.

    Every (color, shape) pair comes once before any comes twice, in an order drawn from ``seed``; the background,
    the position and the size of the shape too."""
    import numpy as np
    import torch
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    pairs = [(c, s) for c in COLORS for s in SHAPES]
    rng.shuffle(pairs)
    images, captions = [], []
    for i in range(num_images):
        color, shape = pairs[i % len(pairs)]
        image = Image.new("RGB", (size, size), rng.choice(BACKGROUNDS))
        side = rng.uniform(0.45, 0.8) * size
        x0, y0 = rng.uniform(0, size - side), rng.uniform(0, size - side)
        box = (x0, y0, x0 + side, y0 + side)
        draw = ImageDraw.Draw(image)
        if shape == "circle":
            draw.ellipse(box, fill=COLORS[color])
        elif shape == "square":
            draw.rectangle(box, fill=COLORS[color])
        else:
            draw.polygon([(x0 + side / 2, y0), (x0, y0 + side), (x0 + side, y0 + side)], fill=COLORS[color])
        images.append(np.asarray(image, dtype=np.float32))
        captions.append(f"{INSTANCE_PROMPT} {color} {shape}")
    pixels = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2)         # (N, 3, H, W), 0..255
    return pixels / 127.5 - 1.0, captions


def caption_tokenizer(max_length: int):
    """A CLIPTokenizer built here, offline: the CLIP BPE over a vocabulary of the captions' words (each one token,
    "a</w>", "photo</w>", ...), every lowercase letter and digit (any other word is spelled out letter by letter)
    and CLIP's two special tokens."""
    import string

    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    merges: list[tuple[str, str]] = []
    for c in string.ascii_lowercase + string.digits:
        vocab.setdefault(c, len(vocab))
        vocab.setdefault(c + "</w>", len(vocab))
    for word in " ".join([INSTANCE_PROMPT, *COLORS, *SHAPES]).split():
        left = word[0]
        for i in range(1, len(word)):
            right = word[i] + ("</w>" if i == len(word) - 1 else "")
            if (left, right) not in merges:
                merges.append((left, right))
            left += right
            vocab.setdefault(left, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)


# ---------------------------------------------------------------------------------------------------- models

def unet_config(model: str, size: int) -> dict:
    """UNet2DConditionModel arguments: the real SD1.5 / SDXL U-Nets (859,520,964 / 2,567,463,684 parameters), or
    a tiny one (2 blocks, 32 / 64 channels)."""
    if model == "tiny":
        return dict(sample_size=size // 8, block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=32,
                    attention_head_dim=8, norm_num_groups=8,
                    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
    if model == "sd15":
        return dict(sample_size=64, block_out_channels=(320, 640, 1280, 1280), layers_per_block=2,
                    cross_attention_dim=768, attention_head_dim=8,
                    down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
                    up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3)
    return dict(sample_size=128, block_out_channels=(320, 640, 1280), layers_per_block=2, cross_attention_dim=2048,
                transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), use_linear_projection=True,
                addition_embed_type="text_time", projection_class_embeddings_input_dim=2816,
                addition_time_embed_dim=256,
                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"))


def vae_config(model: str, size: int) -> dict:
    if model == "tiny":
        return dict(sample_size=size, block_out_channels=(8, 8, 16, 16), layers_per_block=1, latent_channels=4,
                    norm_num_groups=4, down_block_types=("DownEncoderBlock2D",) * 4,
                    up_block_types=("UpDecoderBlock2D",) * 4)
    # the SD VAE (83.7 M parameters), which SDXL keeps with another latent scale
    return dict(sample_size=size, block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=4,
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                scaling_factor=0.13025 if model == "sdxl" else 0.18215)


def text_configs(model: str, vocab_size: int) -> list[dict]:
    """CLIPTextConfig arguments of the text encoder(s): the real widths (SD1.5: 768; SDXL: 768 and 1280, whose
    penultimate states concatenate to 2048 and whose projection gives the pooled (B, 1280)), 2 layers each: only
    the shapes the U-Net reads matter. Token ids are caption_tokenizer's (the pooled output is read at the first
    <|endoftext|>, id 1)."""
    tokens = TEXT_TOKENS[model]
    ids = dict(vocab_size=vocab_size, max_position_embeddings=tokens, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    if model == "tiny":
        return [dict(hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2, **ids)]
    clip_l = dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=2, **ids)
    if model == "sd15":
        return [clip_l]
    return [clip_l, dict(hidden_size=1280, intermediate_size=5120, num_attention_heads=20, num_hidden_layers=2,
                         projection_dim=1280, **ids)]


@dataclass
class Components:
    unet: object
    vae: object
    tokenizer: object
    text_encoders: list


def build_models(model: str, size: int, seed: int, device="cpu") -> Components:
    """The random-weight models of ``model`` in fp32, initialized on ``device``: the same weights for the same seed
    and device (the tiny model is built on the CPU everywhere; SDXL's 2.6 B parameters are drawn on the GPU)."""
    import diffusers
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    tokenizer = caption_tokenizer(TEXT_TOKENS[model])
    with torch.device(device):
        unet = diffusers.UNet2DConditionModel(**unet_config(model, size))
        vae = diffusers.AutoencoderKL(**vae_config(model, size))
        encoders = []
        for i, kwargs in enumerate(text_configs(model, len(tokenizer))):
            kind = CLIPTextModelWithProjection if i == 1 else CLIPTextModel
            encoders.append(kind(CLIPTextConfig(**kwargs)))
    return Components(unet=unet, vae=vae, tokenizer=tokenizer, text_encoders=encoders)


def encode_captions(parts: Components, captions: list[str]):
    """(encoder_hidden_states (N, L, D), pooled (N, 1280) for SDXL else None), in fp32 on the encoders' device.

    SD1.5 reads the last layer's states; SDXL the penultimate states of both encoders side by side (768 + 1280 =
    2048) and the second encoder's projected pooled output, as its pipeline does."""
    import torch

    ids = parts.tokenizer(captions, padding="max_length", max_length=parts.tokenizer.model_max_length,
                          truncation=True, return_tensors="pt").input_ids
    with torch.no_grad():
        if len(parts.text_encoders) == 1:
            encoder = parts.text_encoders[0]
            return encoder(ids.to(encoder.device)).last_hidden_state.float(), None
        states, pooled = [], None
        for encoder in parts.text_encoders:
            out = encoder(ids.to(encoder.device), output_hidden_states=True)
            states.append(out.hidden_states[-2])
            pooled = getattr(out, "text_embeds", None)
    return torch.cat(states, dim=-1).float(), pooled.float()


_TIME_IDS: dict = {}


def predict_noise(unet, noisy, timesteps, text, pooled, size: int):
    """The U-Net's noise prediction (B, 4, h, w); SDXL's added conditions: the pooled text (B, 1280) and the
    time ids (B, 6) = (original height, width, crop top, left, target height, width), here the uncropped size."""
    import torch

    added = None
    if pooled is not None:
        key = (size, text.dtype, text.device)
        if key not in _TIME_IDS:   # made once: a host-to-device copy cannot be part of a recorded step
            _TIME_IDS[key] = torch.tensor([size, size, 0, 0, size, size], dtype=text.dtype, device=text.device)
        added = {"text_embeds": pooled, "time_ids": _TIME_IDS[key].expand(noisy.shape[0], 6)}
    return unet(noisy, timesteps, encoder_hidden_states=text, added_cond_kwargs=added).sample


def add_lora(unet, recipe) -> list:
    """Freeze the U-Net, add the adapter (sits_lora's or PEFT's, as ``recipe.adapter`` of the recipe's
    ``DiffusionRecipe`` says, at its rank, alpha and kernel) on the attention projections; return the trainable
    parameters, in fp32 (the base may be bf16)."""
    import torch
    from peft import LoraConfig

    from sits_lora import SitsLoraConfig

    unet.requires_grad_(False)
    common = dict(r=recipe.rank, lora_alpha=recipe.alpha, target_modules=list(ATTENTION))
    config = SitsLoraConfig(kernel=recipe.kernel, **common) if recipe.adapter == "sits" else LoraConfig(**common)
    unet.add_adapter(config)
    params = [p for p in unet.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.to(torch.float32)
    return params


def tiny_pipeline(parts: Components, unet):
    """A StableDiffusionPipeline of the tiny model around ``unet``."""
    import diffusers

    scheduler = diffusers.DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                        clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    return diffusers.StableDiffusionPipeline(vae=parts.vae, text_encoder=parts.text_encoders[0],
                                             tokenizer=parts.tokenizer, unet=unet, scheduler=scheduler,
                                             safety_checker=None, feature_extractor=None,
                                             requires_safety_checker=False)


# ---------------------------------------------------------------------------------------------------- encoded data

@dataclass
class Cache:
    """What the frozen models give once: the images' latent mean and std (N, 4, h, w) and text states."""

    mean: object
    std: object
    text: object           # (N, L, D)
    pooled: object         # (N, 1280) or None
    scaling: float


def encode_dataset(parts: Components, pixels, captions: list[str], device) -> Cache:
    """Run the frozen VAE and text encoder(s) once on ``device``; they go back to the CPU after."""
    import torch

    parts.vae.to(device)
    for encoder in parts.text_encoders:
        encoder.to(device)
    means, stds = [], []
    with torch.no_grad():
        for image in pixels.split(1):           # one at a time: the VAE's activations at 1024 px are GBs
            dist = parts.vae.encode(image.to(device)).latent_dist
            means.append(dist.mean.float())
            stds.append(dist.std.float())
    text, pooled = encode_captions(parts, captions)
    parts.vae.to("cpu")
    for encoder in parts.text_encoders:
        encoder.to("cpu")
    return Cache(torch.cat(means), torch.cat(stds), text, pooled, float(parts.vae.config.scaling_factor))


def step_generator(seed: int, step: int):
    """The generator of one step's draws: a resumed run draws what an uninterrupted one would have."""
    import torch

    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def sample_batch(cache: Cache, step: int, recipe, num_train_timesteps: int):
    """(image indices (B,), latent draw (B, 4, h, w), noise (B, 4, h, w), timesteps (B,)) of ``step``, on the CPU."""
    import torch

    gen = step_generator(recipe.seed, step)
    n = cache.mean.shape[0]
    shape = (recipe.batch_size, *cache.mean.shape[1:])
    index = torch.randint(n, (recipe.batch_size,), generator=gen)
    return (index, torch.randn(shape, generator=gen), torch.randn(shape, generator=gen),
            torch.randint(num_train_timesteps, (recipe.batch_size,), generator=gen))

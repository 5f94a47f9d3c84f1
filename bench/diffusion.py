"""Per-image time of a diffusers pipeline with a LoRA on its U-Net, and one LoRA training step of the U-Net.

    python bench/diffusion.py --out OUT                          # on a GPU: SD1.5 (512²) and SDXL (1024²) shapes
    python bench/diffusion.py --out OUT --shapes sd15 --train    # + one training step, SD1.5 U-Net, bs 8
    python bench/diffusion.py --smoke --out OUT                  # seconds on a CPU: tiny configs, checks the script

Protocol of shared/ANCHORS.md ("Diffusion"): random weights in the real U-Net / VAE shapes (no hub), LoRA r16 on
the cross-attention projections attn2.to_k / attn2.to_v, 30 denoising steps at batch 2 (classifier-free guidance)
plus one VAE decode, bf16, eager; every arm's pipeline is built first, then one warm-up image each, then --repeats
rounds of one image per arm in turn (--order blocked: each arm's images in a row): the median of each arm's rounds.
On CUDA each timed image is also split, without waiting, on the GPU's clock (an event at each step's end) and the
host's: gpu_* / host_* first step, median step, after the last step (ms). The text encoder does not
run: the prompt goes in as random embeddings (it is the same for every arm, and a pipeline runs it once an image).

Arms, each on a copy of the same U-Net with the same LoRA weights (B drawn non-zero, so the LoRA changes the image):
  base           no adapter
  peft           PEFT's LoRA layers, unmerged (the reference image of the fidelity columns)
  peft+merged    PEFT's LoRA merged into the weights (merge_adapter)
  sits           sits_lora's layers, unmerged: to_k / to_v fused as siblings, their output kept across the
                 denoising steps while the text embeddings are the same tensor (sits_lora.siblings)
  sits+noreuse   the same without keeping it (reuse_cross_attention_kv(unet, False)): every step computes K / V
  sits+fused     sits with every call on the fused Triton kernels (ops.set_aten_below_flops(0)); by default calls
                 below that threshold run as ATen matmuls (sits_lora.ops.aten)
  X+fuseqkv      arm X with each attention's q / k / v (self-attention) and k / v (cross-attention) as one linear
                 (diffusers' fuse_qkv_projections; before fp8: one cast and one GEMM instead of three); base or +merged
  X+graph        arm X with its U-Net's forward recorded as CUDA graphs (sits_lora.diffusion.graph_denoiser):
                 the first image records, the timed ones replay
  X+cl           arm X with the U-Net and the VAE in channels_last memory format (cuDNN's convolutions' own layout)
  X+compile      arm X with the U-Net's forward compiled (torch.compile, default mode; the first image compiles)
  X+rcompile     arm X with the U-Net's transformer blocks compiled one by one (diffusers' compile_repeated_blocks:
                 a few block shapes to compile instead of the whole U-Net)
  X+bcompile     arm X with every block compiled one by one (sits_lora.diffusion.compile_blocks): the U-Net's
                 transformer blocks, ResNet blocks, down- and upsamplers (GroupNorm, SiLU and the residual adds fused
                 by inductor around cuDNN's convolutions), and the VAE's decoder as a whole; a sits arm's kept
                 cross-attention to_k / to_v run outside the compiled graphs (sits+noreuse+...: inside, every step)
  Any kind (base, peft, sits) takes any of these modifiers, e.g. sits+fp8+cl+compile+graph.
  X+fp8          arm X with the U-Net's linear layers fed >= 256 rows a call in e4m3 with static input scales
                 (sits_lora.diffusion.calibrate on two other prompts at the same settings, then quantize_fp8);
                 LoRA layers keep their adapter in bf16 over an fp8 base
  X+fp8c         X+fp8 and the U-Net's convolutions and the VAE decoder's layers in e4m3 too (quantize_fp8 with
                 convolutions=True, vae_decoder=True: sits_lora's implicit-GEMM Triton convolution)
Fidelity: the decoded image of each arm against the bf16 LoRA model's (the peft arm's, or sits' when peft does not
run), same seed and latents: PSNR (images in [0, 1]) and the largest absolute difference.

--train: one step of LoRA training on the SD1.5 U-Net shape (bs 8, 64² latents = 512² images, r16 on
to_q / to_k / to_v / to_out.0 of every attention, MSE on the noise, fused AdamW), against the frozen U-Net (forward
+ backward to the input, no optimizer): arms train:frozen, train:peft, train:sits, train:sits+fused and each of
frozen / peft / sits +graph (the whole step recorded as a CUDA graph, sits_lora.training.graph_train_step); every
arm's model built first, then --train-rounds rounds of 5 timed steps per arm in turn (the median round).

Writes OUT/diffusion.json, .csv and diffusion.png (times and the images side by side).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import png, print_table, write_results  # noqa: E402

INFERENCE_ARMS = ["base", "peft", "peft+merged", "sits", "sits+noreuse", "sits+fused", "base+graph", "peft+graph",
                  "sits+graph", "sits+fp8", "base+fp8+graph", "sits+fp8+graph"]
ARM_KINDS = ("base", "peft", "sits")
ARM_MODIFIERS = ("merged", "fuseqkv", "noreuse", "fused", "fp8", "fp8c", "cl", "compile", "rcompile", "bcompile", "graph")
TRAIN_ARMS = ["train:frozen", "train:peft", "train:sits", "train:sits+fused", "train:frozen+graph", "train:peft+graph",
              "train:sits+graph"]
TRAIN_KINDS = ("frozen", "peft", "sits")
TRAIN_MODIFIERS = ("fused", "graph")
INFERENCE_TARGETS = ["attn2.to_k", "attn2.to_v"]
TRAIN_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]

# U-Net / VAE configurations of the released checkpoints (their config.json), random weights
SHAPES = {
    "sd15": dict(
        unet=dict(sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
                  block_out_channels=(320, 640, 1280, 1280), cross_attention_dim=768, attention_head_dim=8,
                  down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
                  up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3),
        vae=dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=4, sample_size=512,
                 down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4),
        resolution=512, text_dim=768, pooled_dim=None),
    "sdxl": dict(
        unet=dict(sample_size=128, in_channels=4, out_channels=4, layers_per_block=2,
                  block_out_channels=(320, 640, 1280), cross_attention_dim=2048, attention_head_dim=(5, 10, 20),
                  transformer_layers_per_block=(1, 2, 10), use_linear_projection=True,
                  down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                  up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                  addition_embed_type="text_time", addition_time_embed_dim=256,
                  projection_class_embeddings_input_dim=2816),
        vae=dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=4, sample_size=1024,
                 scaling_factor=0.13025, down_block_types=("DownEncoderBlock2D",) * 4,
                 up_block_types=("UpDecoderBlock2D",) * 4),
        resolution=1024, text_dim=2048, pooled_dim=1280),
}
SMOKE_SHAPES = {
    "tiny": dict(
        unet=dict(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
                  cross_attention_dim=24, attention_head_dim=8, norm_num_groups=8,
                  down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                  up_block_types=("UpBlock2D", "CrossAttnUpBlock2D")),
        vae=dict(block_out_channels=(8, 16), layers_per_block=1, latent_channels=4, norm_num_groups=8,
                 down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2),
        resolution=16, text_dim=24, pooled_dim=None),
}


def build_base(shape: dict, device: str, dtype):
    """(unet, vae) with random weights, made on the device."""
    import diffusers

    torch.manual_seed(0)
    with torch.device(device):
        unet = diffusers.UNet2DConditionModel(**shape["unet"]).to(dtype).eval()
        vae = diffusers.AutoencoderKL(**shape["vae"]).to(dtype).eval()
    unet.requires_grad_(False)
    vae.requires_grad_(False)
    return unet, vae


def adapt(unet, arm: str, targets: list[str]):
    """A copy of ``unet`` with the arm's adapter, its LoRA B drawn the same way for every arm."""
    from peft import LoraConfig

    from sits_lora import SitsLoraConfig
    from sits_lora.diffusion import reuse_cross_attention_kv

    model = copy.deepcopy(unet)
    kind = arm.split(":")[-1].split("+")[0]
    if kind in ("base", "frozen"):
        return model
    config = LoraConfig if kind == "peft" else SitsLoraConfig
    model.add_adapter(config(r=16, lora_alpha=16, lora_dropout=0.0, target_modules=targets))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():   # A and B drawn here, so that every arm has the same (B = 0 would give the base model)
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                std = p.shape[1] ** -0.5 if "lora_A" in name else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    if "merged" in arm.split("+"):
        from peft.tuners.tuners_utils import BaseTunerLayer

        for module in model.modules():
            if isinstance(module, BaseTunerLayer):
                module.merge()
    if "noreuse" in arm.split("+"):
        reuse_cross_attention_kv(model, False)
    return model


def fused_only(arm: str):
    """A context in which every sits_lora call takes the fused kernels when the arm says "+fused"."""
    from sits_lora import ops

    class Threshold:
        def __enter__(self):
            self.before = ops.aten_below_flops()
            if "fused" in arm.split(":")[-1].split("+"):
                ops.set_aten_below_flops(0)

        def __exit__(self, *exc):
            ops.set_aten_below_flops(self.before)

    return Threshold()


SCHEDULERS = ("ddim", "euler")


def make_scheduler(kind: str = "ddim"):
    """The noise schedule of SD1.5 / SDXL (scaled linear betas). "ddim": DDIMScheduler, whose step indexes a CPU
    table with the GPU timestep and compares it with 0, so the host waits for the GPU every step (its time before
    the denoiser's launch is then added to the step); "euler": EulerDiscreteScheduler as SDXL's checkpoint
    configures it, whose step reads host-side sigmas (no wait: the host runs ahead)."""
    import diffusers

    common = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1)
    if kind == "euler":
        return diffusers.EulerDiscreteScheduler(**common, timestep_spacing="leading")
    return diffusers.DDIMScheduler(**common, clip_sample=False, set_alpha_to_one=False)


def pipeline(name: str, unet, vae, arm: str = "base", calibration_calls: list | None = None, min_rows: int = 256,
             scheduler: str = "ddim"):
    """The arm's pipeline; an fp8 arm calibrates on ``calibration_calls`` (pipeline kwargs) and quantizes first."""
    import diffusers

    scheduler = make_scheduler(scheduler)
    if SHAPES.get(name, {}).get("pooled_dim"):
        pipe = diffusers.StableDiffusionXLPipeline(vae=vae, text_encoder=None, text_encoder_2=None, tokenizer=None,
                                                   tokenizer_2=None, unet=unet, scheduler=scheduler)
    else:
        pipe = diffusers.StableDiffusionPipeline(vae=vae, text_encoder=None, tokenizer=None, unet=unet,
                                                 scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                                 requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    if "fuseqkv" in arm.split("+"):
        if any("lora_" in n for n, _ in pipe.unet.named_parameters()) and "merged" not in arm.split("+"):
            raise SystemExit(f"arm {arm}: +fuseqkv replaces to_q / to_k / to_v by one linear made from their "
                             "weights, which drops an unmerged LoRA; use it with +merged or on base")
        pipe.unet.fuse_qkv_projections()   # diffusers': self-attention's q / k / v and cross-attention's k / v
    if "fp8" in arm.split("+") or "fp8c" in arm.split("+"):
        from sits_lora.diffusion import calibrate, quantize_fp8

        calls = list(calibration_calls or [])
        calibration = calibrate(pipe, calls)
        convolutions = "fp8c" in arm.split("+")
        if convolutions:
            pipe.vae = copy.deepcopy(pipe.vae)   # the VAE is shared by the arms: this one quantizes its own
        report = quantize_fp8(pipe, calibration, min_rows=min_rows, convolutions=convolutions,
                              vae_decoder=convolutions)
        print(f"[{name} {arm}] {report.summary()}", flush=True)
    if "cl" in arm.split("+"):
        pipe.unet.to(memory_format=torch.channels_last)
        pipe.vae = copy.deepcopy(pipe.vae).to(memory_format=torch.channels_last)   # the VAE is shared by the arms
    if "compile" in arm.split("+"):
        pipe.unet.forward = torch.compile(pipe.unet.forward)
    if "rcompile" in arm.split("+"):
        pipe.unet.compile_repeated_blocks()   # diffusers' regional compilation: each transformer block alone
    if "bcompile" in arm.split("+"):
        from sits_lora.diffusion import compile_blocks

        pipe.vae = copy.deepcopy(pipe.vae)   # the VAE is shared by the arms: this one compiles its own
        compile_blocks(pipe, channels_last="cl" in arm.split("+"))
    if "graph" in arm.split("+") and torch.cuda.is_available() and next(unet.parameters()).is_cuda:
        from sits_lora.diffusion import graph_denoiser

        graph_denoiser(pipe)
    return pipe


def prompt(shape: dict, device: str, dtype, seed: int = 2) -> dict:
    gen = torch.Generator().manual_seed(seed)
    text = torch.randn(1, 77, shape["text_dim"], generator=gen).to(device, dtype)
    kwargs = dict(prompt_embeds=text, negative_prompt_embeds=torch.zeros_like(text))
    if shape["pooled_dim"]:
        pooled = torch.randn(1, shape["pooled_dim"], generator=gen).to(device, dtype)
        kwargs.update(pooled_prompt_embeds=pooled, negative_pooled_prompt_embeds=torch.zeros_like(pooled))
    return kwargs


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_image(pipe, kwargs: dict, steps: int, resolution: int, device: str):
    """(seconds, the image (C, H, W) in [0, 1], float32 on the CPU, the split) of one generation, seeded alike for
    every arm. On CUDA the split says where the image's time went without changing it: a CUDA event recorded at the
    end of each step (no wait) gives the GPU's clock there, the host's clock is read at the same points; milliseconds
    from the start: the first step, the median step and what follows the last step, on each clock. A host step equal
    to the GPU's step means the host set the pace."""
    gen = torch.Generator(device).manual_seed(3)
    events, host_stamps = [], []

    def mark(pipe_, step, timestep, callback_kwargs):
        host_stamps.append(time.perf_counter())
        events.append(torch.cuda.Event(enable_timing=True))
        events[-1].record()
        return {}

    extra = {"callback_on_step_end": mark} if device == "cuda" else {}
    sync(device)
    start_event = torch.cuda.Event(enable_timing=True) if device == "cuda" else None
    start = time.perf_counter()
    if start_event is not None:
        start_event.record()
    with torch.no_grad():
        out = pipe(**kwargs, num_inference_steps=steps, guidance_scale=7.5, height=resolution, width=resolution,
                   generator=gen, output_type="pt", **extra)
    if start_event is not None:
        end_event = torch.cuda.Event(enable_timing=True)
        end_event.record()
    sync(device)
    seconds = time.perf_counter() - start
    split = {}
    if events:
        gpu = [start_event.elapsed_time(e) for e in events]
        host = [(t - start) * 1e3 for t in host_stamps]
        split = {"gpu_first_step_ms": gpu[0], "gpu_step_ms": median_gap(gpu),
                 "gpu_after_steps_ms": start_event.elapsed_time(end_event) - gpu[-1],
                 "host_first_step_ms": host[0], "host_step_ms": median_gap(host),
                 "host_after_steps_ms": seconds * 1e3 - host[-1]}
    return seconds, out.images[0].float().cpu(), split


def median_gap(stamps: list):
    """The median difference between consecutive stamps (in their unit), or None for fewer than two."""
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return statistics.median(gaps) if gaps else None


def image_phases(pipe, kwargs: dict, steps: int, resolution: int, device: str) -> dict:
    """Where one generation's time goes, from a step callback that waits for the GPU and stamps the clock: the first
    step with everything before it (latents, timesteps, a recording's first replay), the median of the other steps
    (the denoiser call, the guidance and the scheduler: what a U-Net profile alone misses), and what follows the last
    step (the VAE decode and the postprocessing); the host's own time a step (stamps without waiting); then, on CUDA,
    the same generation under torch.profiler: the GPU's kernel time against the wall time. Milliseconds."""
    stamps, waits = [], [True]

    def stamp(pipe_, step, timestep, callback_kwargs):
        if waits[0]:
            sync(device)
        stamps.append(time.perf_counter())
        return {}

    call = dict(**kwargs, num_inference_steps=steps, guidance_scale=7.5, height=resolution, width=resolution,
                output_type="pt")
    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        pipe(**call, generator=torch.Generator(device).manual_seed(3), callback_on_step_end=stamp)
    sync(device)
    end = time.perf_counter()
    step = median_gap(stamps)
    phases = {"phase_total_ms": (end - start) * 1e3, "phase_first_step_ms": (stamps[0] - start) * 1e3,
              "phase_step_ms": step * 1e3 if step is not None else None,
              "phase_after_steps_ms": (end - stamps[-1]) * 1e3}
    # the host's own time a step: the same stamps without waiting for the GPU (the host runs ahead while the GPU
    # queue has room). Below phase_step_ms: the GPU sets the pace; about equal: the host does
    stamps.clear()
    waits[0] = False
    with torch.no_grad():
        pipe(**call, generator=torch.Generator(device).manual_seed(3), callback_on_step_end=stamp)
    sync(device)
    host_step = median_gap(stamps)
    phases["phase_host_step_ms"] = host_step * 1e3 if host_step is not None else None
    if device == "cuda":
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            sync(device)
            start = time.perf_counter()
            with torch.no_grad():
                pipe(**call, generator=torch.Generator(device).manual_seed(3))
            sync(device)
            wall = time.perf_counter() - start
        kernels = [e for e in prof.key_averages() if getattr(e, "device_type", None) == DeviceType.CUDA]
        phases.update(profiled_wall_ms=wall * 1e3, kernel_ms=sum(e.device_time_total for e in kernels) / 1e3,
                      kernel_calls=sum(e.count for e in kernels))
    return phases


def merge_costs(pipe, shape: dict, kwargs: dict, steps: int) -> dict:
    """sits_lora.diffusion.merge_plan's costs on this arm's pipeline as it is set up (fp8, compiled blocks, graphs):
    one guided denoiser call unmerged and merged, one merge + unmerge, and the images from which merging pays."""
    from sits_lora.diffusion import measure_denoiser_costs

    unet = pipe.unet
    latent = shape["resolution"] // 8
    param = next(unet.parameters())
    text = torch.cat([kwargs["negative_prompt_embeds"], kwargs["prompt_embeds"]])
    inputs = dict(sample=torch.randn(2, 4, latent, latent, generator=torch.Generator().manual_seed(6)).to(
        param.device, param.dtype), timestep=torch.full((2,), 500, device=param.device), encoder_hidden_states=text)
    if shape["pooled_dim"]:
        res = shape["resolution"]
        inputs["added_cond_kwargs"] = {
            "text_embeds": torch.cat([kwargs["negative_pooled_prompt_embeds"], kwargs["pooled_prompt_embeds"]]),
            "time_ids": torch.tensor([[res, res, 0, 0, res, res]] * 2, device=param.device, dtype=param.dtype)}
    costs = measure_denoiser_costs(unet, inputs=inputs)
    return {"denoise_unmerged_ms": costs.unmerged_ms, "denoise_merged_ms": costs.merged_ms,
            "merge_ms": costs.merge_ms, "merge_pays_after_images": costs.crossover_calls / steps}


def fidelity(image: torch.Tensor, reference: torch.Tensor) -> dict:
    if not (torch.isfinite(image).all() and torch.isfinite(reference).all()):
        return {"psnr_db": None, "max_abs": None, "finite": False}
    mse = (image - reference).square().mean().item()
    return {"psnr_db": math.inf if mse == 0 else 10 * math.log10(1.0 / mse),
            "max_abs": (image - reference).abs().max().item(), "finite": True}


def train_step(unet, frozen: bool, batch: int, latent: int, text_dim: int, pooled_dim, device: str, dtype,
               graph: bool = False):
    """One training step of ``unet`` on fixed random inputs, as a function: MSE on the noise and fused AdamW over
    the trainable parameters, or (``frozen``) forward + backward to the input, the floor a LoRA step must pay;
    ``graph``: the step recorded as a CUDA graph after two eager steps (sits_lora.training.graph_train_step)."""
    gen = torch.Generator().manual_seed(4)
    sample = torch.randn(batch, 4, latent, latent, generator=gen).to(device, dtype)
    noise = torch.randn(batch, 4, latent, latent, generator=gen).to(device, dtype)
    text = torch.randn(batch, 77, text_dim, generator=gen).to(device, dtype)
    t = torch.randint(0, 1000, (batch,), generator=gen).to(device)
    added = None
    if pooled_dim:
        added = {"text_embeds": torch.randn(batch, pooled_dim, generator=gen).to(device, dtype),
                 "time_ids": torch.tensor([[1024, 1024, 0, 0, 1024, 1024]] * batch, device=device, dtype=dtype)}
    params = [p for p in unet.parameters() if p.requires_grad]
    optimizer = None if frozen else torch.optim.AdamW(params, lr=1e-4, fused=device == "cuda")
    unet.train()

    def step():
        x = sample.detach().requires_grad_(frozen)
        pred = unet(x, t, encoder_hidden_states=text, added_cond_kwargs=added).sample
        loss = torch.nn.functional.mse_loss(pred.float(), noise.float())
        loss.backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    if graph and device == "cuda":
        from sits_lora.training import graph_train_step

        return graph_train_step(step, optimizer, model=unet)
    return step


def train_step_seconds(unet, arm: str, batch: int, latent: int, text_dim: int, pooled_dim, device: str, dtype,
                       steps: int) -> tuple[float, float | None]:
    """(median seconds of one training step, peak GiB allocated, peak GiB reserved) over ``steps`` timed steps after
    three untimed ones (a graph arm's two eager steps and its recording). A recording's memory pool counts as
    reserved, not allocated, while it replays: compare graph arms by the reserved peak. Both count the weights of
    every arm's model (all are built before the timed rounds): compare differences between arms, not totals."""
    kind, *modifiers = arm.split(":")[-1].split("+")
    if device == "cuda":
        torch.cuda.empty_cache()   # the other arms' cached blocks (and a released recording's pool) leave the reserve
    step = train_step(unet, kind == "frozen", batch, latent, text_dim, pooled_dim, device, dtype,
                      graph="graph" in modifiers)
    for _ in range(3):
        step()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - start)
    if device != "cuda":
        return statistics.median(times), None, None
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30


def is_train(arm: str) -> bool:
    return arm.startswith("train:")


def arm_name(value: str) -> str:
    """An --arms entry: a training arm train:KIND[+MODIFIER...], or an inference arm KIND[+MODIFIER...] (argparse's
    type check)."""
    if value.startswith("train:"):
        kind, *modifiers = value[len("train:"):].split("+")
        if kind in TRAIN_KINDS and len(set(modifiers)) == len(modifiers) and all(m in TRAIN_MODIFIERS
                                                                                 for m in modifiers):
            return value
        raise argparse.ArgumentTypeError(
            f"invalid training arm {value!r}: train:KIND[+MODIFIER...] with KIND one of {', '.join(TRAIN_KINDS)} and "
            f"each MODIFIER once, one of {', '.join(TRAIN_MODIFIERS)}")
    kind, *modifiers = value.split("+")
    unknown = [m for m in modifiers if m not in ARM_MODIFIERS]
    if kind not in ARM_KINDS or unknown or len(set(modifiers)) != len(modifiers):
        raise argparse.ArgumentTypeError(
            f"invalid arm {value!r}: KIND[+MODIFIER...] with KIND one of {', '.join(ARM_KINDS)} and each MODIFIER "
            f"once, one of {', '.join(ARM_MODIFIERS)}; or a training arm train:KIND[+MODIFIER...], KIND one of "
            f"{', '.join(TRAIN_KINDS)}, MODIFIER of {', '.join(TRAIN_MODIFIERS)}")
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["sd15", "sdxl"])
    parser.add_argument("--arms", nargs="+", type=arm_name, default=INFERENCE_ARMS,
                        help=f"inference arms KIND[+MODIFIER...], KIND one of {', '.join(ARM_KINDS)}, MODIFIER of "
                             f"{', '.join(ARM_MODIFIERS)} (see above); training arms {', '.join(TRAIN_ARMS)}")
    parser.add_argument("--train", action="store_true", help="add the training-step arms (SD1.5 shape)")
    parser.add_argument("--steps", type=int, default=30, help="denoising steps per image")
    parser.add_argument("--merge-costs", action="store_true",
                        help="after the timed images, time merge_plan's costs on each adapter arm as set up (one "
                             "denoiser call unmerged / merged, one merge + unmerge): when merging pays")
    parser.add_argument("--scheduler", choices=SCHEDULERS, default="ddim",
                        help="ddim (the runs so far; its step makes the host wait for the GPU) or euler (SDXL's own, "
                             "no wait); see make_scheduler")
    parser.add_argument("--phases", action="store_true",
                        help="after the timed images, more images per arm with the clock stamped at each step "
                             "(first step, a step, after the last step, the host's time a step: phase_*_ms) and, "
                             "on CUDA, one under torch.profiler (kernel_ms against profiled_wall_ms)")
    parser.add_argument("--order", choices=("interleaved", "blocked"), default="interleaved",
                        help="interleaved: the timed images in rounds, one per arm in turn (drift spreads over the "
                             "arms alike); blocked: each arm's images in a row (what one arm costs after another's)")
    parser.add_argument("--repeats", type=int, default=3, help="images timed per arm, after one warm-up image")
    parser.add_argument("--train-batch", type=int, default=8)
    parser.add_argument("--train-rounds", type=int, default=4,
                        help="rounds of 5 timed steps per training arm, arms in turn: the median round")
    parser.add_argument("--smoke", action="store_true", help="tiny configs on any device (checks the script)")
    args = parser.parse_args(argv)
    for flag in ("steps", "repeats", "train_batch", "train_rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if importlib.util.find_spec("diffusers") is None:
        parser.error("needs diffusers: pip install 'sits-lora[diffusion]'")
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if device == "cpu" and not args.smoke:
        parser.error("the SD1.5 / SDXL shapes need a CUDA GPU; --smoke runs tiny configs on a CPU")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shapes = SMOKE_SHAPES if args.smoke else {name: SHAPES[name] for name in args.shapes}
    steps, repeats = (2, 1) if args.smoke else (args.steps, args.repeats)
    arms = [a for a in args.arms if not is_train(a)] + (TRAIN_ARMS if args.train else
                                                         [a for a in args.arms if is_train(a)])
    rows, images = [], {}
    for name, shape in shapes.items():
        unet, vae = build_base(shape, device, dtype)
        kwargs = prompt(shape, device, dtype)
        reference = None
        # every arm's pipeline at once, timed in rounds (arm 1, arm 2, ..., arm 1, ...): the host's and the GPU's
        # speed drift over a run (clocks, other tenants), and rounds spread that drift over every arm alike
        inference = [a for a in arms if not is_train(a)]
        # the fidelity columns compare each image with the bf16 LoRA model's: PEFT's arm, else ours unmerged
        reference_arm = next((a for a in ("peft", "sits") if a in inference), None)
        # fp8 arms calibrate on two prompts other than the timed one, at the timed settings
        calibration_calls = [dict(prompt(shape, device, dtype, seed=s), num_inference_steps=steps, guidance_scale=7.5,
                                  height=shape["resolution"], width=shape["resolution"], output_type="pt")
                             for s in (7, 8)]
        pipes = {arm: pipeline(name, adapt(unet, arm, INFERENCE_TARGETS), vae, arm, calibration_calls,
                               min_rows=0 if args.smoke else 256, scheduler=args.scheduler) for arm in inference}
        times, splits = {arm: [] for arm in inference}, {arm: [] for arm in inference}
        # round 0 warms up (allocator, autotuning, the kept K / V); "blocked" takes each arm's images in a row
        order = ([(round_, arm) for round_ in range(repeats + 1) for arm in inference] if args.order == "interleaved"
                 else [(round_, arm) for arm in inference for round_ in range(repeats + 1)])
        for round_, arm in order:
            with fused_only(arm):
                seconds, image, split = time_image(pipes[arm], kwargs, steps, shape["resolution"], device)
            if round_:
                times[arm].append(seconds)
                splits[arm].append(split)
            images[(name, arm)] = image
            # each image as it comes: a run cut short by a time limit still says what it measured
            print(f"[{name} {arm}] round {round_}{' (warm-up)' if not round_ else ''}: {seconds:.3f} s"
                  + "".join(f", {k} {v:.1f}" for k, v in split.items() if v is not None), flush=True)
        for arm in inference:
            seconds = statistics.median(times[arm])
            reference = images[(name, arm)] if arm == reference_arm else reference
            rows.append({"shape": name, "arm": arm, "seconds_per_image": seconds, "times": times[arm],
                         "fidelity_reference": reference_arm, "order": args.order,
                         "steps": steps, "scheduler": args.scheduler, "lora_targets": " ".join(INFERENCE_TARGETS)})
            # the timed images' split (CUDA): the median of each field over the repeats
            for key in splits[arm][0] if splits[arm] else ():
                values = [sp[key] for sp in splits[arm] if sp.get(key) is not None]
                rows[-1][key] = statistics.median(values) if values else None
            print(f"[{name} {arm}] {seconds:.3f} s per image ({' '.join(f'{t:.3f}' for t in times[arm])})",
                  flush=True)
            if args.phases:
                with fused_only(arm):
                    rows[-1].update(image_phases(pipes[arm], kwargs, steps, shape["resolution"], device))
                print(f"[{name} {arm}] phases: " + ", ".join(f"{k} {v:.1f}" for k, v in rows[-1].items()
                                                             if k.startswith(("phase_", "kernel_", "profiled_"))),
                      flush=True)
            parts = arm.split("+")
            if args.merge_costs and parts[0] != "base" and "merged" not in parts:
                rows[-1].update(merge_costs(pipes[arm], shape, kwargs, steps))
                print(f"[{name} {arm}] merge_plan costs: {rows[-1]['denoise_unmerged_ms']:.2f} ms a call unmerged, "
                      f"{rows[-1]['denoise_merged_ms']:.2f} merged, merge + unmerge {rows[-1]['merge_ms']:.1f} ms: "
                      f"merging pays after {rows[-1]['merge_pays_after_images']:.1f} images", flush=True)
        del pipes
        if device == "cuda":
            torch.cuda.empty_cache()
        base = next((r["seconds_per_image"] for r in rows if r["shape"] == name and r["arm"] == "base"), None)
        for r in rows:
            if r["shape"] == name and "seconds_per_image" in r:
                r["vs_base"] = r["seconds_per_image"] / base if base else None
                if reference is not None:
                    r.update(fidelity(images[(name, r["arm"])], reference))
        if name in ("sd15", "tiny"):
            latent = shape["resolution"] // 8
            batch = 2 if args.smoke else args.train_batch
            # every arm's model first, then rounds of a few steps per arm in turn (the host drifts, as above)
            train_arms = [a for a in arms if is_train(a)]
            if device != "cuda" and any("graph" in a.split("+") for a in train_arms):
                print("[train] the +graph arms record CUDA graphs: skipped on the CPU", flush=True)
                train_arms = [a for a in train_arms if "graph" not in a.split("+")]
            models = {arm: adapt(unet, arm, TRAIN_TARGETS) for arm in train_arms}
            step_times = {arm: [] for arm in train_arms}
            peaks, reserved = {}, {}
            for round_ in range(1 if args.smoke else args.train_rounds):
                for arm in train_arms:
                    with fused_only(arm):
                        seconds, peak, held = train_step_seconds(models[arm], arm, batch, latent, shape["text_dim"],
                                                           shape["pooled_dim"], device, dtype,
                                                           steps=3 if args.smoke else 5)
                    step_times[arm].append(seconds)
                    peaks[arm] = peak if peak is None else max(peak, peaks.get(arm) or 0.0)
                    reserved[arm] = held if held is None else max(held, reserved.get(arm) or 0.0)
            for arm in train_arms:
                seconds = statistics.median(step_times[arm])
                rows.append({"shape": name, "arm": arm, "train_step_s": seconds, "times": step_times[arm],
                             "peak_gib": peaks[arm], "peak_reserved_gib": reserved[arm], "batch": batch,
                             "lora_targets": "" if arm.startswith("train:frozen") else " ".join(TRAIN_TARGETS)})
                print(f"[{name} {arm}] {seconds * 1000:.1f} ms per training step, bs {batch} "
                      f"(rounds: {' '.join(f'{t * 1000:.1f}' for t in step_times[arm])})", flush=True)
            del models
            if device == "cuda":
                torch.cuda.empty_cache()
            # the floor: the fastest frozen arm (eager or graphed); PEFT: its eager step (the baseline) and
            # its fastest arm
            trained = [r for r in rows if r["shape"] == name and "train_step_s" in r]
            floor_row = min((r for r in trained if r["arm"].startswith("train:frozen")),
                            key=lambda r: r["train_step_s"], default=None)
            peft = next((r["train_step_s"] for r in trained if r["arm"] == "train:peft"), None)
            best_peft = min((r["train_step_s"] for r in trained if r["arm"].startswith("train:peft")), default=None)
            for r in trained:
                r["floor_arm"] = floor_row["arm"] if floor_row else None
                r["vs_frozen"] = r["train_step_s"] / floor_row["train_step_s"] if floor_row else None
                r["peft_over_this"] = peft / r["train_step_s"] if peft else None
                r["best_peft_over_this"] = best_peft / r["train_step_s"] if best_peft else None
        del unet, vae
    command = "python bench/diffusion.py " + " ".join(argv if argv is not None else sys.argv[1:])
    paths = write_results("diffusion", rows, args.out, {"command": command})
    print_table([r for r in rows if "seconds_per_image" in r],
                ["shape", "arm", "seconds_per_image", "vs_base", "psnr_db", "max_abs"])
    print_table([r for r in rows if "train_step_s" in r], ["shape", "arm", "train_step_s", "vs_frozen",
                                                            "peft_over_this", "best_peft_over_this", "peak_gib",
                                                            "peak_reserved_gib"])
    picture(rows, images, os.path.join(args.out, "diffusion.png"))
    print("wrote", *paths)
    return 0


def picture(rows: list[dict], images: dict, path: str) -> None:
    """Seconds per image by arm (bars) above each arm's image, one row per shape."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        with png(path):
            return
    shapes = sorted({name for name, _ in images})
    arms = list(dict.fromkeys(a for _, a in images))   # in the order they ran
    if not shapes or not arms:
        return
    fig = Figure(figsize=(2.4 * len(arms), 2.6 * len(shapes) + 2.4))
    ax = fig.add_subplot(len(shapes) + 1, 1, 1)
    for i, name in enumerate(shapes):
        values = [next((r["seconds_per_image"] for r in rows if r["shape"] == name and r["arm"] == a), 0) for a in arms]
        ax.bar([j + 0.4 * i for j in range(len(arms))], values, width=0.4, label=name)
    ax.set_xticks([j + 0.2 for j in range(len(arms))], arms)
    ax.set_ylabel("s per image")
    ax.legend()
    for i, name in enumerate(shapes):
        for j, arm in enumerate(arms):
            if (name, arm) not in images:
                continue
            sub = fig.add_subplot(len(shapes) + 1, len(arms), (i + 1) * len(arms) + j + 1)
            sub.imshow(images[(name, arm)].clamp(0, 1).permute(1, 2, 0).numpy())
            r = next(r for r in rows if r["shape"] == name and r["arm"] == arm)
            psnr = r.get("psnr_db")
            sub.set_title(f"{name} {arm}\n{'' if psnr is None else f'{psnr:.1f} dB'}", fontsize=7)
            sub.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=60)   # the sample images are noise (random weights): they do not compress


if __name__ == "__main__":
    sys.exit(main())

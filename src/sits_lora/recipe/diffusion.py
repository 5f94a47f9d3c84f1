"""The diffusion recipe (``recipes/train_diffusion.py`` runs :func:`main`): a DreamBooth-style LoRA fine-tune of a
diffusers U-Net with a sits_lora adapter, fully offline. What it does and writes: that script's docstring and
docs/usage.md, "Diffusion training recipe". torch and diffusers load inside the functions, after the options are
checked, so that a bad option answers at once."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

# the recipe's run files, data and models stay reachable here too (sits_lora.recipe.diffusion.draw_shapes, ...)
from .diffusion_files import (KEEP_CHECKPOINTS, RUN_FILES, STATE_FILE, checkpoint_dirs, export_lora,  # noqa: F401
                              latest_checkpoint, plot_losses, read_metrics, replace_folder, run_files, save_checkpoint)
from .diffusion_models import (ATTENTION, BACKGROUNDS, COLORS, INSTANCE_PROMPT, SHAPES, TEXT_TOKENS,  # noqa: F401
                               Cache, Components, add_lora, build_models, caption_tokenizer, draw_shapes,
                               encode_captions, encode_dataset, predict_noise, sample_batch, step_generator,
                               text_configs, tiny_pipeline, unet_config, vae_config)
from ..utils import validation
from .train import KERNELS, true_or_false, write_json_atomically   # none of them imports torch

MODELS = ("tiny", "sd15", "sdxl")
ADAPTERS = ("sits", "peft")
# (the VAE's downsampling, the U-Net's: 2 ** (down blocks - 1)): --resolution is a multiple of their product
DOWNSAMPLING = {"tiny": (8, 2), "sd15": (8, 8), "sdxl": (8, 4)}
NATIVE_RESOLUTION = {"tiny": 32, "sd15": 512, "sdxl": 1024}
DEFAULT_LR = {"tiny": 1e-2, "sd15": 1e-4, "sdxl": 1e-4}
EXIT_INTERRUPTED = 130


@dataclass
class DiffusionRecipe:
    model: str = field(default="tiny", metadata={
        "help": "tiny | sd15 | sdxl, all with random weights. tiny: CPU and CI. sd15 / sdxl: the real U-Net shapes "
                "(860 M / 2.6 B parameters), a CUDA GPU only (a step takes minutes on a CPU)"})
    adapter: str = field(default="sits", metadata={
        "help": "sits: SitsLoraConfig (sits_lora's layers); peft: PEFT's LoraConfig, for comparison"})
    kernel: str = field(default="auto", metadata={
        "help": "auto | triton | torch (SitsLoraConfig.kernel; auto: the Triton kernels on a CUDA GPU)"})
    steps: int = field(default=100, metadata={"help": "optimizer steps (in all, a resumed run included)"})
    batch_size: int = field(default=2, metadata={"help": "images per step"})
    resolution: int = field(default=0, metadata={
        "help": "image side in pixels; 0 = the model's own (tiny 32, sd15 512, sdxl 1024); a multiple of the VAE's "
                "and the U-Net's downsampling (tiny 16, sd15 64, sdxl 32)"})
    num_images: int = field(default=8, metadata={"help": "images drawn for the training set"})
    lr: float = field(default=0.0, metadata={
        "help": "AdamW learning rate (constant); 0 = the model's: tiny 1e-2 (a random model learns visibly in 20 "
                "steps), sd15 / sdxl 1e-4 (DreamBooth LoRA's usual rate)"})
    rank: int = field(default=4, metadata={"help": "LoRA rank"})
    lora_alpha: float = field(default=0.0, metadata={"help": "LoRA alpha (scaling = alpha / rank); 0 = the rank"})
    seed: int = field(default=0, metadata={"help": "seed of the images, the random weights and every step's noise"})
    output_dir: str = field(default="out/sits-diffusion", metadata={
        "help": "where metrics.jsonl, summary.json, loss.png, lora/ and checkpoints go"})
    save_every: int = field(default=0, metadata={"help": "a checkpoint every N steps; 0 = three per run"})
    resume: bool = field(default=False, metadata={
        "help": "continue from the latest checkpoint-N in output_dir (an interrupted run leaves one there)"})
    overwrite: bool = field(default=False, metadata={
        "help": "replace another run in output_dir; without it (or resume) such a folder is refused"})
    cuda_graphs: bool = field(default=False, metadata={
        "help": "record the whole step (forward, backward, clipping, fused AdamW) as a CUDA graph after two eager "
                "steps and replay it (sits_lora.training.graph_train_step): the host's time leaves the step. A "
                "non-finite step is skipped on the GPU and stops the run as without it. CUDA GPU only"})

    def __post_init__(self) -> None:
        validation.validate(_OPTION_CHECKS, lambda name: getattr(self, name),
                            lambda name, value: f"{_flag(name)} {value!r}")
        if self.kernel != "auto" and self.adapter != "sits":
            raise ValueError(f"--kernel {self.kernel} applies to --adapter sits only (PEFT's LoRA has one "
                             f"implementation); drop --kernel or use --adapter sits")
        if self.resume and self.overwrite:
            raise ValueError("--resume true and --overwrite true contradict each other: resume continues the run in "
                             "--output-dir, overwrite replaces it; choose one")
        vae, unet = DOWNSAMPLING[self.model]
        step = vae * unet
        if isinstance(self.resolution, bool) or not isinstance(self.resolution, int) or self.resolution < 0 or \
                self.resolution % step:
            below = self.resolution // step * step if isinstance(self.resolution, int) else 0
            fits = f"{below} or {below + step}" if below > 0 else f"{step}"
            raise ValueError(f"--resolution {self.resolution!r} is invalid for --model {self.model}: it must be a "
                             f"multiple of {step} (the VAE downsamples by {vae}, the U-Net by {unet}); use "
                             f"--resolution {fits}, or 0 for the model's {NATIVE_RESOLUTION[self.model]}")

    @property
    def size(self) -> int:
        """The image side in pixels."""
        return self.resolution or NATIVE_RESOLUTION[self.model]

    @property
    def learning_rate(self) -> float:
        return self.lr or DEFAULT_LR[self.model]

    @property
    def alpha(self) -> float:
        return self.lora_alpha or self.rank

    def checkpoint_steps(self) -> int:
        """save_every, or three checkpoints per run when it is 0."""
        return self.save_every or max(1, -(-self.steps // 3))

    def check_output_dir(self) -> None:
        """output_dir can be written to, and holds no other run unless --resume or --overwrite says what to do."""
        try:
            os.makedirs(self.output_dir, exist_ok=True)
            probe = os.path.join(self.output_dir, f".write-test-{os.getpid()}")
            with open(probe, "w") as f:
                f.write("ok")
            os.remove(probe)
        except OSError as error:
            raise ValueError(f"--output-dir {self.output_dir} is not writable ({error.strerror or error}); choose a "
                             f"folder you can write to") from None
        if self.resume:
            if latest_checkpoint(self.output_dir) is None:
                raise ValueError(f"--resume true: {self.output_dir} holds no checkpoint-N folder to continue from; "
                                 f"run without --resume")
            return
        previous = run_files(self.output_dir)
        if previous and not self.overwrite:
            raise ValueError(f"--output-dir {self.output_dir} holds another run ({', '.join(previous[:4])}); pass "
                             f"--resume true to continue it, --overwrite true to replace it, or another --output-dir")

    def check_machine(self) -> None:
        """What this machine cannot run, refused before any model is built."""
        import torch

        if self.model != "tiny" and not torch.cuda.is_available():
            raise ValueError(f"--model {self.model} needs a CUDA GPU (its U-Net has "
                             f"{'860 M' if self.model == 'sd15' else '2.6 B'} parameters: a step takes minutes on a "
                             f"CPU); use --model tiny on this machine")
        if self.cuda_graphs and not torch.cuda.is_available():
            raise ValueError("--cuda-graphs true records CUDA graphs and needs a CUDA GPU; drop it on this machine")
        if self.kernel == "triton" and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("--kernel triton needs a CUDA GPU (or TRITON_INTERPRET=1, the kernels on the CPU, slowly, "
                             "for tests); use --kernel auto on this machine")

    def check_resume(self, saved: dict) -> None:
        """The options a checkpoint fixes (the base weights, the data, the adapter's shape) match this run's."""
        fixed = ("model", "adapter", "rank", "lora_alpha", "resolution", "num_images", "seed")
        for name in fixed:
            if saved.get(name) != getattr(self, name):
                raise ResumeError(f"--resume true: the checkpoint was trained with {_flag(name)} {saved.get(name)!r}, "
                                  f"this run asks for {getattr(self, name)!r}; resume with the same {_flag(name)} "
                                  f"(or start another run in another --output-dir)")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# The options' own checks, in the one validation style (sits_lora.utils.validation: standard library only, so a bad
# value answers before torch loads); the rules between options follow them in DiffusionRecipe.__post_init__
_OPTION_CHECKS: dict[str, validation.Check] = {
    "model": validation.choice(MODELS),
    "adapter": validation.choice(ADAPTERS),
    "kernel": validation.choice(KERNELS),
    **{name: validation.positive_int(f", e.g. {_flag(name)} {DiffusionRecipe.__dataclass_fields__[name].default}")
       for name in ("steps", "batch_size", "num_images", "rank")},
    "save_every": validation.non_negative_int(" (0: three checkpoints per run)"),
    "lr": validation.non_negative_number(", e.g. --lr 1e-4 (0: the model's default)"),
    "lora_alpha": validation.non_negative_number(" (0: the rank)"),
}


class NonFiniteTrainingError(FloatingPointError):
    """A step's loss or a trainable gradient holds NaN or Inf."""


class ResumeError(ValueError):
    """The checkpoint --resume would continue from does not fit this run's options."""


# ---------------------------------------------------------------------------------------------------- training

def diffusion_loss(unet, scheduler, cache: Cache, index, draw, noise, timesteps, size: int, autocast):
    """MSE between the noise and the U-Net's prediction of it from the noised latents."""
    import torch

    device = cache.mean.device
    index, timesteps = index.to(device), timesteps.to(device)
    latents = (cache.mean[index] + cache.std[index] * draw.to(device)) * cache.scaling      # (B, 4, h, w)
    noise = noise.to(device)
    noisy = scheduler.add_noise(latents, noise, timesteps)
    pooled = cache.pooled[index] if cache.pooled is not None else None
    with autocast():
        pred = predict_noise(unet, noisy, timesteps, cache.text[index], pooled, size)
    return torch.nn.functional.mse_loss(pred.float(), noise)


def fixed_noise_loss(unet, scheduler, cache: Cache, recipe: DiffusionRecipe, autocast) -> float:
    """The loss over every image at 4 fixed timesteps (100, 350, 600, 850) with fixed noise: the same draws before
    and after training, so the two numbers compare (a step's loss swings with its random timesteps)."""
    import torch

    gen = torch.Generator().manual_seed(recipe.seed + 12345)
    n = cache.mean.shape[0]
    total, count = 0.0, 0
    was_training = unet.training
    unet.eval()
    with torch.no_grad():
        for t in (100, 350, 600, 850):
            for start in range(0, n, recipe.batch_size):
                index = torch.arange(start, min(n, start + recipe.batch_size))
                shape = (len(index), *cache.mean.shape[1:])
                draw, noise = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
                timesteps = torch.full((len(index),), t)
                loss = diffusion_loss(unet, scheduler, cache, index, draw, noise, timesteps, recipe.size, autocast)
                total += loss.item() * len(index)
                count += len(index)
    unet.train(was_training)
    return total / count


class _StopRequest:
    """The first Ctrl-C asks the loop to stop after its step (the checkpoint is then whole); a second one
    raises KeyboardInterrupt at once."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        try:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        except ValueError:                     # not the main thread: Ctrl-C stays a plain KeyboardInterrupt
            self._previous = None
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        return False


def check_export(parts: Components, base_unet, trained_unet, lora_dir: str, cache: Cache, recipe: DiffusionRecipe,
                 base_dir: str) -> dict:
    """Save the tiny base pipeline to base_dir, load lora_dir into it with load_lora_weights (stock diffusers,
    no sits_lora layer) and compare its U-Net's output with the trained one's on the first batch."""
    import diffusers
    import torch

    trained_unet.to("cpu")                     # the tiny model's weights stay fp32 on CUDA too
    cache = Cache(*(t.cpu() if t is not None else None for t in (cache.mean, cache.std, cache.text, cache.pooled)),
                  cache.scaling)
    pipe = tiny_pipeline(parts, base_unet)
    tmp = base_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp)
    replace_folder(tmp, base_dir)
    verbosity = diffusers.utils.logging.get_verbosity()
    diffusers.utils.logging.set_verbosity_error()    # not "No LoRA keys ... for CLIPTextModel": only the U-Net has one
    try:
        pipe.load_lora_weights(lora_dir)
    finally:
        diffusers.utils.logging.set_verbosity(verbosity)
    scheduler = diffusers.DDPMScheduler.from_config(pipe.scheduler.config)
    index, draw, noise, timesteps = sample_batch(cache, 0, recipe, scheduler.config.num_train_timesteps)
    latents = (cache.mean[index] + cache.std[index] * draw) * cache.scaling
    noisy = scheduler.add_noise(latents, noise, timesteps)
    with torch.no_grad():
        ref = predict_noise(trained_unet, noisy, timesteps, cache.text[index], None, recipe.size)
        out = predict_noise(pipe.unet, noisy, timesteps, cache.text[index], None, recipe.size)
    rel_err = ((out - ref).norm() / ref.norm()).item()
    return {"loads_with_load_lora_weights": True, "rel_err_vs_trained_unet": rel_err, "ok": rel_err < 1e-4,
            "base_pipeline": os.path.abspath(base_dir)}


@dataclass
class LoopOutcome:
    done: int                       # the last step whose update was applied
    status: str                     # "finished", "interrupted" or "nonfinite"
    error: Optional[Exception] = None
    mid_update: bool = False        # interrupted inside optimizer.step: the weights are half updated
    seconds: float = 0.0


def _raise_on_bad_gradients(checked, step: int) -> None:
    if checked.nonfinite:
        others = len(checked.bad_parameters) - 1
        raise NonFiniteTrainingError(
            f"step {step}: the gradient of {checked.bad_parameters[0]} holds NaN or Inf"
            + (f" (and {others} other parameter(s))" if others > 0 else ""))


def recorded_step(unet, params, optimizer, scheduler, cache: Cache, recipe: DiffusionRecipe, autocast):
    """The training step as one CUDA graph (sits_lora.training.graph_train_step): (loss, skipped) of the step
    from the step's batch on the GPU. No host decision inside: a non-finite loss or gradient norm sets ``skipped``
    and fused AdamW's ``found_inf``, which skips the update (and its step count) on the GPU; the gradients stay in
    ``.grad`` until the next step, for the guard to name the bad parameter."""
    import torch

    from sits_lora.training import graph_train_step

    def step(index, draw, noise, timesteps):
        optimizer.zero_grad(set_to_none=True)   # first, so that backward makes fresh gradients, left for the guard
        loss = diffusion_loss(unet, scheduler, cache, index, draw, noise, timesteps, recipe.size, autocast)
        loss.backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        skipped = (~torch.isfinite(norm + loss.detach())).float()
        # clipped by 1 when skipped: a NaN norm would spread NaN to every gradient, and the guard would name them all
        torch.nn.utils.clip_grads_with_norm_(params, 1.0, torch.where(skipped > 0, torch.zeros_like(norm), norm))
        optimizer.found_inf = skipped
        optimizer.step()
        return loss.detach(), skipped

    return graph_train_step(step, optimizer, model=unet)


def train_steps(unet, params, optimizer, scheduler, cache: Cache, recipe: DiffusionRecipe, start: int,
                checkpoint, autocast, log) -> LoopOutcome:
    """Steps start + 1 .. recipe.steps: a line of ``log`` per step, ``checkpoint(step)`` every
    recipe.checkpoint_steps(); stops at the first non-finite loss or gradient (not applied) and at Ctrl-C."""
    import torch
    from tqdm.auto import tqdm

    from sits_lora.training.guards import GradientGuard

    guard = GradientGuard(policy="skip")       # "skip": a bad step's gradients are dropped; the error names it
    guard.bind(unet)
    recorded = (recorded_step(unet, params, optimizer, scheduler, cache, recipe, autocast) if recipe.cuda_graphs
                else None)
    every = recipe.checkpoint_steps()
    outcome = LoopOutcome(done=start, status="finished")
    t_start = time.perf_counter()
    bar = tqdm(total=recipe.steps, initial=start, desc="training", unit="step", dynamic_ncols=True)
    try:
        with _StopRequest() as stop:
            for step in range(start + 1, recipe.steps + 1):
                t0 = time.perf_counter()
                batch = sample_batch(cache, step, recipe, scheduler.config.num_train_timesteps)
                if recorded is not None:
                    # the update of a non-finite step was skipped on the GPU; the checks below name what was bad
                    outcome.mid_update = True
                    loss, skipped = recorded(*(t.to(cache.mean.device) for t in batch))
                    value, skipped = torch.stack([loss, skipped]).tolist()    # one wait for the GPU a step
                    outcome.mid_update = False
                    if not math.isfinite(value):
                        raise NonFiniteTrainingError(f"step {step}: the loss is {value}")
                    if skipped:
                        _raise_on_bad_gradients(guard.check(step), step)
                else:
                    loss = diffusion_loss(unet, scheduler, cache, *batch, recipe.size, autocast)
                    value = loss.item()
                    if not math.isfinite(value):
                        raise NonFiniteTrainingError(f"step {step}: the loss is {value}")
                    loss.backward()
                    _raise_on_bad_gradients(guard.check(step), step)
                    torch.nn.utils.clip_grad_norm_(params, 1.0)
                    outcome.mid_update = True
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    outcome.mid_update = False
                outcome.done = step
                log.write(json.dumps({"step": step, "loss": value, "seconds": time.perf_counter() - t0}) + "\n")
                log.flush()
                bar.update(1)
                bar.set_postfix(loss=f"{value:.4f}")
                if step % every == 0 and step < recipe.steps:
                    checkpoint(step)
                if stop.requested:
                    outcome.status = "interrupted"
                    break
    except KeyboardInterrupt:
        outcome.status = "interrupted"
    except NonFiniteTrainingError as error:
        outcome.status, outcome.error = "nonfinite", error
    finally:
        bar.close()
    outcome.seconds = time.perf_counter() - t_start
    return outcome


def _resume_state(recipe: DiffusionRecipe) -> tuple:
    """(the latest checkpoint's folder, its training state) when ``--resume`` finds one, else (None, None); a
    checkpoint the options do not fit raises ResumeError."""
    import torch

    resume_from = latest_checkpoint(recipe.output_dir) if recipe.resume else None
    state = torch.load(os.path.join(resume_from, STATE_FILE), map_location="cpu") if resume_from else None
    if state is not None:
        recipe.check_resume(state["recipe"])
        if recipe.steps <= state["step"]:
            raise ResumeError(f"--steps {recipe.steps}: the checkpoint {resume_from} is at step {state['step']} "
                              f"already; pass a larger --steps to train on")
    return resume_from, state


def _restore(state: dict, named: dict, optimizer, recipe: DiffusionRecipe, metrics_path: str,
             resume_from: str) -> tuple:
    """The adapter and the optimizer as the checkpoint left them, the metrics of the steps after it dropped (they
    are trained again); (the step to start from, the fixed-noise loss before training)."""
    import torch

    with torch.no_grad():
        for n, p in named.items():
            p.copy_(state["adapter"][n])
    optimizer.load_state_dict(state["optimizer"])
    for group in optimizer.param_groups:
        group["lr"] = recipe.learning_rate     # a resumed run may change it (after a NaN: lower it)
    start = state["step"]
    kept = [m for m in read_metrics(recipe.output_dir) if m["step"] <= start]
    with open(metrics_path + ".tmp", "w") as f:
        f.writelines(json.dumps(m) + "\n" for m in kept)
    os.replace(metrics_path + ".tmp", metrics_path)
    print(f"[sits_lora] resuming from {resume_from} (step {start})")
    return start, state.get("eval_loss_before")


def run(recipe: DiffusionRecipe) -> tuple[int, dict]:
    """Train; return (exit status, summary): 0 finished, 1 a non-finite loss or gradient, 130 interrupted."""
    import copy

    import diffusers
    import torch

    out = recipe.output_dir
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    resume_from, state = _resume_state(recipe)
    t_start = time.perf_counter()
    pixels, captions = draw_shapes(recipe.num_images, recipe.size, recipe.seed)
    parts = build_models(recipe.model, recipe.size, recipe.seed, "cpu" if recipe.model == "tiny" else device)
    base_unet = copy.deepcopy(parts.unet) if recipe.model == "tiny" else None    # for the load check
    cache = encode_dataset(parts, pixels, captions, device)
    unet = parts.unet.to(device)
    if cuda and recipe.model != "tiny":
        unet.to(torch.bfloat16)      # the frozen base in bf16, the adapter in fp32, under bf16 autocast
    params = add_lora(unet, recipe)
    named = {n: p for n, p in unet.named_parameters() if p.requires_grad}
    unet.train()
    scheduler = diffusers.DDPMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                        num_train_timesteps=1000, clip_sample=False)

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    # fused: one kernel for the update, and the only AdamW that skips a non-finite step on the GPU (found_inf),
    # which a recorded step needs
    optimizer = torch.optim.AdamW(params, lr=recipe.learning_rate, weight_decay=1e-2, fused=recipe.cuda_graphs)
    if recipe.overwrite:     # only now: a run that fails while building leaves the old one whole
        for name in run_files(out):
            path = os.path.join(out, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    start, eval_before = 0, None
    metrics_path = os.path.join(out, "metrics.jsonl")
    if state is not None:
        start, eval_before = _restore(state, named, optimizer, recipe, metrics_path, resume_from)
    if eval_before is None:
        eval_before = fixed_noise_loss(unet, scheduler, cache, recipe, autocast)

    trainable = sum(p.numel() for p in params)
    print(f"[sits_lora] {recipe.model} U-Net, {sum(p.numel() for p in unet.parameters()) / 1e6:.1f} M parameters "
          f"(random weights), {recipe.adapter} LoRA rank {recipe.rank} on {', '.join(ATTENTION)}: {trainable:,} "
          f"trainable; {recipe.num_images} images at {recipe.size} px; {device.type}, "
          f"{'bf16 autocast' if cuda else 'fp32'}")

    def checkpoint(step):
        return save_checkpoint(out, step, named, optimizer, recipe, {"eval_loss_before": eval_before})

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with open(metrics_path, "a") as log:
        loop = train_steps(unet, params, optimizer, scheduler, cache, recipe, start, checkpoint, autocast, log)
    if loop.status == "interrupted" and loop.mid_update:
        print(f"[sits_lora] interrupted inside the update of step {loop.done + 1}: nothing saved over the last "
              f"checkpoint ({latest_checkpoint(out) or 'none'})", file=sys.stderr)
        return EXIT_INTERRUPTED, {}

    saved = checkpoint(loop.done) if loop.done > start else latest_checkpoint(out)
    lora_dir = export_lora(unet, out)
    eval_after = fixed_noise_loss(unet, scheduler, cache, recipe, autocast) if loop.status != "nonfinite" else None
    export_check = None
    if recipe.model == "tiny" and loop.status == "finished":
        export_check = check_export(parts, base_unet, unet, lora_dir, cache, recipe, os.path.join(out, "base"))
    summary = _summary(recipe, loop, start, state is not None, eval_before, eval_after, t_start, trainable, lora_dir,
                       saved, export_check, diffusers.__version__)
    write_json_atomically(os.path.join(out, "summary.json"), summary)
    return _report_end(recipe, loop, summary, saved, loop.done - start), summary


def _summary(recipe: DiffusionRecipe, loop, start: int, resumed: bool, eval_before: float,
             eval_after: Optional[float], t_start: float, trainable: int, lora_dir: str, saved: Optional[str],
             export_check: Optional[dict], diffusers_version: str) -> dict:
    """summary.json's content (and loss.png drawn from the metrics on the way)."""
    import torch

    from sits_lora.utils.env import environment

    out = recipe.output_dir
    metrics = read_metrics(out)
    if metrics:
        plot_losses(metrics, os.path.join(out, "loss.png"), f"{recipe.model} U-Net (random weights), {recipe.adapter} "
                    f"LoRA rank {recipe.rank}, {recipe.num_images} images at {recipe.size} px")
    last = [m["loss"] for m in metrics[-10:]]
    trained = loop.done - start
    cuda = torch.cuda.is_available()
    return {
        "status": loop.status,
        "error": str(loop.error) if loop.error else None,
        "steps_done": loop.done,
        "resumed_from_step": start if resumed else None,
        "final_loss": metrics[-1]["loss"] if metrics else None,
        "mean_loss_last_10": sum(last) / len(last) if last else None,
        "fixed_noise_loss_before": eval_before,
        "fixed_noise_loss_after": eval_after,
        "steps_per_second": trained / loop.seconds if trained else None,
        "train_seconds": loop.seconds,
        "wall_seconds": time.perf_counter() - t_start,
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "trainable_parameters": trainable,
        "lora_dir": os.path.abspath(lora_dir),
        "checkpoint": os.path.abspath(saved) if saved else None,
        "export_check": export_check,
        "config": dataclasses.asdict(recipe),
        "environment": {**environment(), "diffusers": diffusers_version},
    }


def _report_end(recipe: DiffusionRecipe, loop, summary: dict, saved: Optional[str], trained: int) -> int:
    """The run's last lines, and its exit status: 1 for a non-finite step or an exported LoRA that does not give
    the trained U-Net's outputs, 130 interrupted, else 0."""
    if loop.status == "nonfinite":
        then = (f"continue with --resume true from {saved}" if saved else
                "run again with --overwrite true (no step was applied, no checkpoint was saved)")
        print(f"error: {loop.error}; nothing was applied at that step. Fix: lower --lr (now "
              f"{recipe.learning_rate:g}) and {then}", file=sys.stderr)
        return 1
    peak = summary["peak_memory_bytes"]
    print(f"[sits_lora] fixed-noise loss {summary['fixed_noise_loss_before']:.4f} -> "
          f"{summary['fixed_noise_loss_after']:.4f}; {trained} steps in {loop.seconds:.1f} s "
          f"({summary['steps_per_second'] or 0:.2f} steps/s)" + (f", peak {peak / 2**30:.2f} GiB" if peak else ""))
    print(f"[sits_lora] LoRA saved to {summary['lora_dir']} (pipe.load_lora_weights reads it)")
    if loop.status == "interrupted":
        print(f"[sits_lora] interrupted after step {loop.done}: checkpoint {saved}; --resume true continues",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    export_check = summary["export_check"]
    if export_check is not None:
        print(f"[sits_lora] load_lora_weights on the base pipeline ({export_check['base_pipeline']}): relative "
              f"difference {export_check['rel_err_vs_trained_unet']:.1e} from the trained U-Net")
        if not export_check["ok"]:
            print("error: the exported LoRA, loaded with load_lora_weights, does not give the trained U-Net's "
                  "outputs", file=sys.stderr)
            return 1
    return 0


# ---------------------------------------------------------------------------------------------------- command line

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(DiffusionRecipe):
        kind = {bool: true_or_false, int: int, float: float}.get(type(f.default), str)
        extra = dict(nargs="?", const=True) if kind is true_or_false else {}   # `--resume` = `--resume true`
        parser.add_argument(_flag(f.name), dest=f.name, type=kind, default=None,
                            help=f"{f.metadata['help']} (default {f.default})", **extra)
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        recipe = DiffusionRecipe(**{k: v for k, v in vars(args).items() if v is not None})
        if importlib.util.find_spec("diffusers") is None:
            raise ValueError("the diffusion recipe needs diffusers: pip install 'sits-lora[diffusion]'")
        recipe.check_machine()
        recipe.check_output_dir()
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        status, _ = run(recipe)
    except ResumeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return status


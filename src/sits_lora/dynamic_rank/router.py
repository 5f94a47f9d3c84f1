"""The router that picks each token's rank bucket, and the probe that predicts the token's entropy.

One router per adapted layer (not per decoder block): a PEFT layer sees only its own input, so a
per-layer router needs no knowledge of the model's block structure, saves / loads / truncates with
its layer, and lets the budget move rank between projections (q_proj and down_proj see different
hidden states and need different ranks). Its cost: K·d_in weights per layer (K buckets), K/(2r) of
the LoRA branch's arithmetic at d_in = d_out. Counted on SmolLM2-135M with all seven projections
at r = 64 and 5 buckets: 0.75 M router weights (3.8 % of the adapter's 19.5 M) and 1.2 M in the
entropy probes (6.2 %, fitted once and frozen).

Router logits (T, K) = W x̂ + u·ê + c, with x̂ = x / rms(x) (scale-free across projections),
ê the probe's standardized entropy prediction ('entropy-gated' only), u its per-bucket weight
(initialized as a prior: higher predicted entropy, bigger bucket) and c initialized so that the
bucket nearest the target rank wins (``prior_logits``). W starts at zero: every token starts
from the prior.

The routing rule, in training and at inference: bucket = argmax of the logits. Training samples
around it (Gumbel-max, the forward pass uses the sample) with the straight-through gradient of
softmax((logits + noise) / T), because the dimensions of a bucket no token visits would never train
(lora_B starts at zero) and the router would never learn that they help. The budget holds the
argmax decisions at the target, so inference keeps the mean rank training was held to.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from ..ops.reference import device_constant


# Prior slope of the entropy feature: the logit gap between the largest and the smallest bucket per
# standard deviation of predicted entropy. 2.0 makes a token one std above the mean entropy
# e² ≈ 7 times likelier to get the top bucket relative to the bottom one than an average token.
ENTROPY_PRIOR_SLOPE = 2.0
# Hidden width of the entropy probe: 8 units hold its cost to 8·d_in weights per layer (1.2 M on
# SmolLM2-135M with all seven projections adapted, against 19.5 M for the r = 64 adapter itself).
PROBE_HIDDEN = 8
_RMS_EPS = 1e-6


def rms_normalize(x: Tensor) -> Tensor:
    """x / rms(x) over the last dim, in fp32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + _RMS_EPS)


def inverse_rms(x: Tensor) -> Tensor:
    """(T,) fp32 1 / rms(x) of (T, d) x, reduced in fp32 without an fp32 copy of x."""
    sum_sq = torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32).square()
    return torch.rsqrt(sum_sq / x.shape[-1] + _RMS_EPS)


class _RawRouterLinear(torch.autograd.Function):
    """x Wᵀ in fp32 from x in its own dtype; the gradient of W only (x is detached: the router does not
    train the layers below).

    The router's logits are (x Wᵀ)·inv_rms + b (:func:`routing_decision`), not rms_normalize(x) Wᵀ + b:
    the plain form writes an fp32 copy of x and autograd keeps it for dW, T × d_in × 4 bytes per routed
    layer (computed for a Llama-3-8B shape at 8192 tokens: 128 MiB per layer of d_in 4096, 448 MiB per
    down_proj, 38 GiB over all 224). This keeps x only, which the LoRA branch saves anyway.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        ctx.weight_dtype = weight.dtype
        return torch.nn.functional.linear(x, weight.to(x.dtype)).float()          # (T, K)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (x,) = ctx.saved_tensors
        return None, (grad.t().to(x.dtype) @ x).to(ctx.weight_dtype)               # (K, d_in)


class EntropyProbe(nn.Module):
    """Predicts the base model's next-token entropy, standardized, from a layer's input x̂.

    A one-hidden-layer MLP, so that it gives the router a feature that is not linear in x̂ (a linear
    probe would lie in the span of the router's own weights). Fitted once by
    :class:`TokenEntropySampler` and frozen, so that training and inference route with the same
    rule and inference needs no extra pass of the base model. Flat parameters (no submodules):
    PEFT strips the adapter name from keys of the form ``<container>.<adapter>.<tensor>`` only.
    """

    def __init__(self, d_in: int, hidden: int = PROBE_HIDDEN):
        super().__init__()
        layer1, layer2 = nn.Linear(d_in, hidden), nn.Linear(hidden, 1)
        self.w1 = nn.Parameter(layer1.weight.detach().clone())             # (hidden, d_in)
        self.b1 = nn.Parameter(layer1.bias.detach().clone())               # (hidden,)
        self.w2 = nn.Parameter(layer2.weight.detach().reshape(-1).clone())  # (hidden,)
        self.b2 = nn.Parameter(layer2.bias.detach().reshape(()).clone())    # ()
        self.register_buffer("entropy_mean", torch.zeros(()))
        self.register_buffer("entropy_std", torch.ones(()))
        self.register_buffer("fitted", torch.zeros((), dtype=torch.bool))
        self.requires_grad_(False)

    def forward(self, x_hat: Tensor) -> Tensor:
        """(T, d_in) normalized input -> (T,) standardized entropy prediction."""
        hidden = torch.nn.functional.gelu(torch.nn.functional.linear(x_hat.to(self.w1.dtype), self.w1, self.b1))
        return hidden @ self.w2 + self.b2

    def from_raw(self, x: Tensor, inv_rms: Tensor) -> Tensor:
        """The same from the raw input x (T, d_in) and its :func:`inverse_rms` (no fp32 copy of x)."""
        pre = torch.nn.functional.linear(x, self.w1.to(x.dtype)).float() * inv_rms.unsqueeze(1) + self.b1.float()
        return torch.nn.functional.gelu(pre) @ self.w2.float() + self.b2.float()


def prior_logits(buckets: Sequence[int], target_mean_rank: float) -> Tensor:
    """Starting logits: the bucket nearest the target (the lower one on a tie) decided for every token.

    c_k = -|b_k - b*| / Δ with Δ the mean bucket spacing: the decision (argmax) starts as a static
    adapter at about the target rank, and sampling in training still visits the neighbouring buckets
    (for [0, 16, 32, 48, 64] at 16: 52 % at 16, 19 % at 0 and at 32, 10 % above), so their rank
    dimensions train from the first step.
    """
    b = torch.tensor([float(v) for v in buckets])
    nearest = b[torch.argmin((b - target_mean_rank).abs())]
    spacing = float(b[-1] - b[0]) / max(1, len(buckets) - 1) or 1.0
    return -(b - nearest).abs() / spacing


class TokenRouter(nn.Module):
    """Logits over the rank buckets for each token (flat parameters, as EntropyProbe)."""

    def __init__(self, d_in: int, buckets: Sequence[int], target_mean_rank: float, use_entropy: bool):
        super().__init__()
        k = len(buckets)
        self.weight = nn.Parameter(torch.zeros(k, d_in))                   # (K, d_in)
        self.bias = nn.Parameter(prior_logits(buckets, target_mean_rank))  # (K,)
        self.entropy_weight: Optional[nn.Parameter] = None
        if use_entropy:
            b = torch.tensor([float(v) for v in buckets])
            span = float(b[-1] - b[0]) or 1.0
            self.entropy_weight = nn.Parameter(ENTROPY_PRIOR_SLOPE * (b - b.mean()) / span)   # (K,)

    def forward(self, x_hat: Tensor, entropy: Optional[Tensor] = None) -> Tensor:
        """(T, d_in) normalized input [, (T,) standardized entropy] -> (T, K) logits."""
        logits = torch.nn.functional.linear(x_hat.to(self.weight.dtype), self.weight, self.bias)
        return self._add_entropy(logits, entropy)

    def raw(self, x: Tensor) -> Tensor:
        """x Wᵀ (T, K) fp32 from the raw input x (T, d_in): the part of the logits that reads x."""
        return _RawRouterLinear.apply(x, self.weight)

    def from_raw(self, x: Tensor, inv_rms: Tensor, entropy: Optional[Tensor] = None) -> Tensor:
        """The same logits (fp32) from the raw input x (T, d_in) and its :func:`inverse_rms`, without an fp32
        copy of x kept for the gradient (see _RawRouterLinear)."""
        self._require_entropy(entropy)
        logits, _, _, _ = routing_decision(self.raw(x), inv_rms, self.bias, entropy, self.entropy_weight, None, 1.0)
        return logits

    def _require_entropy(self, entropy: Optional[Tensor]) -> None:
        if self.entropy_weight is not None and entropy is None:
            raise ValueError("this router reads the predicted entropy: pass entropy=(T,) values")

    def _add_entropy(self, logits: Tensor, entropy: Optional[Tensor]) -> Tensor:
        self._require_entropy(entropy)
        if self.entropy_weight is not None:
            logits = logits + entropy.to(logits.dtype).unsqueeze(-1) * self.entropy_weight
        return logits


def _gumbel_from_uniform(logits: Tensor, uniform: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """(bucket_ids (T,), bucket_weights (T, K)): hard Gumbel-max choice from ``uniform`` noise in [0, 1),
    softmax gradient: bucket_weights equals one_hot(bucket_ids) in value; its gradient is that of
    softmax((logits + Gumbel noise) / temperature)."""
    noisy = logits.float() - torch.log(-torch.log(uniform.clamp(1e-9, 1.0 - 1e-9)))
    soft = torch.softmax(noisy / temperature, dim=-1)                           # (T, K)
    ids = noisy.argmax(-1)                                                      # (T,)
    hard = torch.nn.functional.one_hot(ids, logits.shape[-1]).to(soft.dtype)
    return ids, hard - soft.detach() + soft


def routing_decision(raw: Tensor, inv_rms: Tensor, bias: Tensor, entropy: Optional[Tensor],
                     entropy_weight: Optional[Tensor], uniform: Optional[Tensor], temperature: float):
    """(logits (T, K) fp32, decided (T,), used (T,), bucket_weights (T, K) or None) from the router's raw
    x Wᵀ (T, K), 1/rms(x) (T,) and the predicted entropy (T,) ('entropy-gated'; None otherwise).

    decided = argmax of the logits (the routing rule); with ``uniform`` (T, K) noise in [0, 1) (training)
    ``used`` is the Gumbel-max sample around it and bucket_weights its straight-through weights; without
    it used = decided and bucket_weights is None. Elementwise work only: on a GPU the layer runs it
    compiled (:func:`route`), one or two kernels instead of about twenty.
    """
    logits = raw * inv_rms.unsqueeze(1) + bias.float()
    if entropy_weight is not None:
        logits = logits + entropy.float().unsqueeze(1) * entropy_weight.float()
    decided = logits.detach().argmax(-1)
    if uniform is None:
        return logits, decided, decided, None
    used, weights = _gumbel_from_uniform(logits, uniform, temperature)
    return logits, decided, used, weights


_COMPILED_ROUTING = {}


def compiled_routing_wanted() -> bool:
    """True only when ``SITS_LORA_COMPILE_ROUTER=1``. Eager is the default: with the eager decision the
    whole routed layer costs no more than with the compiled one, and less at the narrow shapes
    (bench_dynamic_rank_layer.py; the compiled call's own Python cost outweighs the ~20 launches it
    replaces); eager also has no compile wait in each new process (docs/dynamic-rank.md)."""
    return os.environ.get("SITS_LORA_COMPILE_ROUTER", "0") == "1"


def route(raw: Tensor, inv_rms: Tensor, bias: Tensor, entropy: Optional[Tensor], entropy_weight: Optional[Tensor],
          uniform: Optional[Tensor], temperature: float):
    """:func:`routing_decision`: eager by default; with SITS_LORA_COMPILE_ROUTER=1 (:func:`compiled_routing_wanted`)
    compiled by torch.compile on a GPU (never on a CPU, nor inside a model that is itself being compiled,
    which fuses it anyway): a few kernels instead of ~20, yet no cheaper per layer step
    (:func:`compiled_routing_wanted` says why). If compilation fails the eager function runs, after one warning."""
    if (not raw.is_cuda or torch.compiler.is_compiling() or _COMPILED_ROUTING.get("failed")
            or not compiled_routing_wanted()):
        return routing_decision(raw, inv_rms, bias, entropy, entropy_weight, uniform, temperature)
    compiled = _COMPILED_ROUTING.get("fn")
    if compiled is None:
        compiled = _COMPILED_ROUTING["fn"] = torch.compile(routing_decision, dynamic=True)
    try:
        return compiled(raw, inv_rms, bias, entropy, entropy_weight, uniform, temperature)
    except Exception as error:  # a missing compiler toolchain must not stop training: fall back to eager
        import warnings

        _COMPILED_ROUTING["failed"] = True
        warnings.warn(f"sits_lora: compiling the router's decision failed ({type(error).__name__}: "
                      f"{str(error).splitlines()[0] if str(error) else ''}); it runs eagerly (slower, same result).")
        return routing_decision(raw, inv_rms, bias, entropy, entropy_weight, uniform, temperature)


class _AddBudgetGradient(torch.autograd.Function):
    """Identity on bucket_weights whose backward adds ∂(λ · mean active rank / r)/∂bucket_weights.

    Puts the budget's Lagrangian term into any training loop (Trainer, accelerate, a plain loop)
    without touching the loss the loop computes.
    """

    @staticmethod
    def forward(ctx, bucket_weights: Tensor, coefficient: Tensor) -> Tensor:
        ctx.save_for_backward(coefficient)
        return bucket_weights.view_as(bucket_weights)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (coefficient,) = ctx.saved_tensors
        return grad + coefficient.to(grad.dtype), None


def add_budget_gradient(bucket_weights: Tensor, buckets: Sequence[int], lam: float,
                        valid: Optional[Tensor]) -> Tensor:
    """Attach λ·(mean over valid tokens of Σ_k w_k b_k) / r to bucket_weights' gradient (λ < 0 rewards rank)."""
    if lam == 0.0:
        return bucket_weights
    b = device_constant(("buckets", tuple(buckets)), bucket_weights.device,
                        lambda: torch.tensor([float(v) for v in buckets]))                  # (K,)
    weight = valid.float() if valid is not None else torch.ones(bucket_weights.shape[0], device=b.device)
    n = weight.sum().clamp_min(1.0)
    coefficient = (lam / (float(buckets[-1]) * n)) * weight.unsqueeze(1) * b.unsqueeze(0)   # (T, K)
    return _AddBudgetGradient.apply(bucket_weights, coefficient)

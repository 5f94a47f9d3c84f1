"""Data parallel training with sits_lora layers on two gloo ranks (CPU, forked processes): DDP and FSDP2 (the
frozen base sharded, the adapters trained) give the adapters a single process gets from the same global batch, with
the fused Triton path (under the interpreter) and sibling fusion in every layer."""

from __future__ import annotations

import pytest
import torch
from conftest import on_gloo_ranks, randomize_lora_weights, tiny_llama
from peft import get_peft_model

from sits_lora import SitsLoraConfig
from sits_lora.bases.fp8 import Fp8BaseLinear

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GLOBAL_BATCH, SEQ, STEPS = 4, 8, 3


def _model():
    model = get_peft_model(tiny_llama(0), SitsLoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                         kernel="triton", init_lora_weights=False))
    randomize_lora_weights(model)
    return model.train()


def _batch():
    return torch.randint(0, 97, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def _train(model, ids, steps=STEPS) -> list:
    """AdamW steps on ``ids``; the losses (each rank's own in data parallel)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _adapters(model) -> dict:
    """The adapter weights by name, whole (an FSDP2 shard gathered), as numpy arrays: a tensor sent from a forked
    rank through a queue is shared by a file descriptor that is gone once the rank exits."""
    return {n.removeprefix("module."): (p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()).numpy()
            for n, p in model.named_parameters() if "lora_" in n}


def _single_process():
    model = _model()
    losses = _train(model, _batch())
    return losses, _adapters(model)


def _count_fused_calls() -> dict:
    """Count the calls of the fused Triton ops (one layer alone, a sibling group) in this process from now on."""
    from sits_lora import ops
    from sits_lora.ops import linear

    counts = {"layer": 0, "siblings": 0}

    def counted(fn, key):
        def wrapper(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)
        return wrapper

    linear.lora_linear_triton = counted(linear.lora_linear_triton, "layer")
    ops.lora_siblings_triton = counted(ops.lora_siblings_triton, "siblings")
    return counts


def _ddp_rank(rank: int, world: int):
    from torch.nn.parallel import DistributedDataParallel

    from sits_lora.layers.siblings import SiblingGroup

    counts = _count_fused_calls()   # a forked rank: the patch dies with it
    model = _model()
    groups = {id(m.sibling_group) for m in model.modules() if isinstance(getattr(m, "sibling_group", None),
                                                                        SiblingGroup)}
    ddp = DistributedDataParallel(model)
    share = GLOBAL_BATCH // world
    losses = _train(ddp, _batch()[rank * share:(rank + 1) * share])
    return losses, _adapters(model), len(groups), counts


def _fsdp2_rank(rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    counts = _count_fused_calls()
    model = _model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    share = GLOBAL_BATCH // world
    losses = _train(model, _batch()[rank * share:(rank + 1) * share])
    return losses, _adapters(model), counts


def _assert_same_adapters(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys() and len(got) == 2 * len(TARGETS) * 2
    for name, value in expected.items():
        # atol: the ranks sum the gradient in another order, and AdamW (lr 1e-2) turns a float32 difference in a
        # small gradient element into a difference of its update of up to lr x its relative error: one of 320
        # elements differed by 1.2e-5 after 3 steps (atol 1e-5 failed on one CPU). A wrong shard or a missed
        # all-reduce moves them by ~lr.
        torch.testing.assert_close(torch.from_numpy(got[name]), torch.from_numpy(value), rtol=1e-4, atol=5e-5,
                                   msg=name)


def test_ddp_on_two_ranks_trains_the_adapters_a_single_process_does():
    losses, expected = _single_process()
    ranks = on_gloo_ranks(_ddp_rank)
    assert all(isinstance(r, tuple) for r in ranks), ranks
    for rank_losses, adapters, groups, counts in ranks:
        assert groups == 2 * 2                      # q / k / v and gate / up fused in each of the 2 layers
        # per step and layer: the q / k / v and gate / up groups once each, o_proj and down_proj alone
        assert counts == {"siblings": 2 * 2 * STEPS, "layer": 2 * 2 * STEPS}, counts
        _assert_same_adapters(adapters, expected)
    # the mean of the ranks' losses is the global batch's loss (equal token counts per rank), step by step
    for step, loss in enumerate(losses):
        assert sum(r[0][step] for r in ranks) / 2 == pytest.approx(loss, rel=1e-4)


def test_fsdp2_on_two_ranks_trains_the_adapters_a_single_process_does():
    _, expected = _single_process()
    ranks = on_gloo_ranks(_fsdp2_rank)
    if any(isinstance(r, str) and "NotImplementedError" in r for r in ranks):
        pytest.skip(f"FSDP2 on the CPU is not supported by this torch: {ranks[0][:200]}")
    assert all(isinstance(r, tuple) for r in ranks), ranks
    for _, adapters, counts in ranks:
        assert counts == {"siblings": 2 * 2 * STEPS, "layer": 2 * 2 * STEPS}, counts   # the fused path, sharded
        _assert_same_adapters(adapters, expected)


def test_the_recipe_saves_an_fsdp2_sharded_adapter_whole(tmp_path):
    """FSDP2 leaves the adapter as DTensor shards: every rank gathers them, rank 0 writes the PEFT adapter the
    unsharded model writes (the recipe's save; accelerate's FSDP plugin does not run on CPU processes, so the
    sharding here is fully_shard's own)."""
    from safetensors.torch import load_file

    from sits_lora.recipe.train import _save_adapter_atomically

    def body(rank: int, world: int):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = _model()
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        _save_adapter_atomically(model, str(tmp_path / "sharded"), main_process=rank == 0)
        return rank

    assert on_gloo_ranks(body) == [0, 1]
    _save_adapter_atomically(_model(), str(tmp_path / "single"))
    sharded, single = (load_file(str(tmp_path / name / "adapter_model.safetensors")) for name in ("sharded", "single"))
    assert sharded.keys() == single.keys() and len(single) == 2 * len(TARGETS) * 2
    assert all(torch.equal(sharded[k], single[k]) for k in single)


@pytest.mark.parametrize("name, kind", [("ddp", "MULTI_GPU"), ("fsdp2", "FSDP"), ("deepspeed_zero2", "DEEPSPEED"),
                                        ("deepspeed_zero3", "DEEPSPEED")])
def test_the_example_accelerate_configs_load(name, kind):
    """accelerate reads the example configs (an unknown key or a wrong type stops it) and they say what they are."""
    import os

    from accelerate.commands.config.config_args import load_config_from_file
    from conftest import REPO_ROOT

    config = load_config_from_file(os.path.join(REPO_ROOT, "recipes", "configs", "accelerate", f"{name}.yaml"))
    assert str(config.distributed_type).endswith(kind) and config.num_processes == 2
    if kind == "FSDP":
        assert config.fsdp_config["fsdp_version"] == 2
    if kind == "DEEPSPEED":
        assert config.deepspeed_config["zero_stage"] == int(name[-1])


def _fp8_rank(rank: int, world: int):
    """One emulated-fp8 DDP step on this rank's own batch, then the scaling update: the scales every rank takes,
    and the amax this rank saw alone."""
    from torch.nn.parallel import DistributedDataParallel

    from sits_lora.fp8 import fp8_scaling_state, update_scaling

    model = _fp8_model()
    ddp = DistributedDataParallel(model)
    # rank 1's tokens scaled up: its activations' amax differ from rank 0's
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(10 + rank))
    with torch.no_grad():
        model.base_model.model.model.embed_tokens.weight.mul_(1.0 + 3.0 * rank)
    state = fp8_scaling_state(model)
    for _ in range(2):   # the first step casts with each tensor's own amax; the second records the delayed one
        ddp(input_ids=ids, labels=ids).loss.backward()
        own = state.amax.clone()
        update_scaling(model)
    return state.scale.numpy(), own.numpy()


def test_fp8_scales_agree_on_every_rank():
    """Each rank sees its own activations; the delayed scales come from the largest amax of all ranks, the same
    on every rank (what one process with the whole batch would record). DDP starts at all: it leaves the fp8
    weight codes out of its broadcast from rank 0 (gloo cannot send fp8; SitsLoraModel names them)."""
    ranks = on_gloo_ranks(_fp8_rank)
    assert all(isinstance(r, tuple) for r in ranks), ranks
    (scale0, own0), (scale1, own1) = ranks
    assert not (own0 == own1).all()                               # the ranks saw different amax
    torch.testing.assert_close(torch.from_numpy(scale0), torch.from_numpy(scale1), rtol=0, atol=0)


def _fp8_accumulation_rank(rank: int, world: int):
    """Two micro-batches under DDP (the first under no_sync, as gradient accumulation runs them), rank 1's running
    amax raised to a marker between them: what each rank's amax holds after the second."""
    from torch.nn.parallel import DistributedDataParallel

    from sits_lora.fp8 import fp8_scaling_state

    model = _fp8_model()
    ddp = DistributedDataParallel(model)
    state = fp8_scaling_state(model)
    ids = _batch()[rank * 2:(rank + 1) * 2]
    with ddp.no_sync():
        ddp(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        state.amax.fill_(1e6 if rank == 1 else 0.0)   # as if rank 1's first micro-batch had seen 1e6
    ddp(input_ids=ids, labels=ids).loss.backward()
    return state.amax.numpy(), sorted(ddp.parameters_to_ignore)


def test_ddp_leaves_each_ranks_running_amax_alone():
    """DDP broadcasts rank 0's buffers before every forward unless told not to: the fp8 scaling state's running
    amax must keep each rank's earlier micro-batches until update() reduces it over the ranks."""
    ranks = on_gloo_ranks(_fp8_accumulation_rank)
    assert all(isinstance(r, tuple) for r in ranks), ranks
    (amax0, ignored), (amax1, _) = ranks
    assert (amax1 == 1e6).all() and (amax0 < 1e6).all()
    assert any(name.endswith("amax_history") for name in ignored)


def _fp8_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = get_peft_model(LlamaForCausalLM(config), SitsLoraConfig(r=8, target_modules=TARGETS, fp8="hybrid",
                                                                    fp8_emulate=True, fp8_layers="all"))
    randomize_lora_weights(model)
    return model.train()


def _fp8_train(model, ids) -> list:
    """AdamW steps with the delayed fp8 scales updated after each; the scales after every step."""
    from sits_lora.fp8 import fp8_scaling_state, update_scaling

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    state, scales = fp8_scaling_state(model), []
    for _ in range(STEPS):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        update_scaling(model)
        scales.append(state.scale.clone().numpy())
    return scales


def _fp8_rank_of(strategy: str):
    def body(rank: int, world: int):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.nn.parallel import DistributedDataParallel

        model = _fp8_model()
        if strategy == "ddp":
            wrapped = DistributedDataParallel(model)
        else:
            mesh = init_device_mesh("cpu", (world,))
            for block in model.base_model.model.model.layers:
                fully_shard(block, mesh=mesh)
            wrapped = fully_shard(model, mesh=mesh)
        sharded = [n for n, m in model.named_modules()
                   if isinstance(m, Fp8BaseLinear) and hasattr(m.weight, "full_tensor")]
        share = GLOBAL_BATCH // world
        scales = _fp8_train(wrapped, _batch()[rank * share:(rank + 1) * share])
        return scales, _adapters(model), len(sharded)
    return body


def test_fp8_under_fsdp2_trains_the_adapters_ddp_does():
    """FSDP2 shards the frozen fp8 weight codes too (gathered per layer; gloo carries them). Its ranks take the
    delayed scales DDP's ranks take (every rank the same: the largest amax over the ranks) and end at DDP's
    adapters. Not one process's on the whole batch: the first step casts each tensor with its own amax (a rank's
    half batch quantizes differently from the whole), and each rank differentiates its own mean loss (its
    gradients' amax is world x the whole batch's per token)."""
    ddp, fsdp2 = on_gloo_ranks(_fp8_rank_of("ddp")), on_gloo_ranks(_fp8_rank_of("fsdp2"))
    if any(isinstance(r, str) and "NotImplementedError" in r for r in fsdp2):
        pytest.skip(f"FSDP2 on the CPU is not supported by this torch: {fsdp2[0][:200]}")
    assert all(isinstance(r, tuple) for r in ddp + fsdp2), ddp + fsdp2
    for (ddp_scales, ddp_adapters, none_sharded), (scales, adapters, sharded) in zip(ddp, fsdp2):
        assert none_sharded == 0 and sharded == 2 * len(TARGETS)   # every adapted layer's codes are FSDP shards
        for got, want in zip(scales, ddp_scales):
            torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(want), rtol=1e-5, atol=0)
        _assert_same_adapters(adapters, ddp_adapters)
    for step in range(STEPS):   # every rank the same scales
        assert (fsdp2[0][0][step] == fsdp2[1][0][step]).all()


def _fp8_codes_under_a_bf16_policy(rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _fp8_model()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.base_model.model.model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    codes, norms = set(), set()
    for module in model.modules():
        if isinstance(module, Fp8BaseLinear):
            module.register_forward_pre_hook(lambda m, args: codes.add((str(m.weight.dtype), str(m.codes.dtype))))
        elif type(module).__name__ == "LlamaRMSNorm":
            module.register_forward_pre_hook(lambda m, args: norms.add(str(m.weight.dtype)))
    _fp8_train(model, _batch()[:2])
    return sorted(codes), sorted(norms)


def test_fp8_codes_stay_fp8_under_an_fsdp2_bf16_policy():
    """What accelerate's FSDP plugin sets from `mixed_precision: bf16` (a MixedPrecisionPolicy with bf16
    param_dtype) casts every floating-point parameter at each gather, float8 included: the codes, stored as their
    bytes, are gathered as they are, and the fp8 layers read e4m3 (while the policy does cast the norms)."""
    from sits_lora.utils.distributed import fsdp2_shards_integer_parameters

    if not fsdp2_shards_integer_parameters():
        pytest.skip("this torch's FSDP2 cannot shard integer parameters: the codes are stored as float8, which the "
                    "policy casts (the recipe refuses fp8 under accelerate's FSDP plugin there)")
    seen = on_gloo_ranks(_fp8_codes_under_a_bf16_policy, world=1)
    if isinstance(seen[0], str) and "NotImplementedError" in seen[0]:
        pytest.skip(f"FSDP2 on the CPU is not supported by this torch: {seen[0][:200]}")
    assert seen == [([("torch.uint8", "torch.float8_e4m3fn")], ["torch.bfloat16"])], seen   # the norms were cast


def _plan_rank(rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from sits_lora.training.memory import plan_memory

    model = _model()
    whole = plan_memory(model, 2, 8)
    layers = model.base_model.model.model.layers
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    root = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in in_layers)
    layer = max(sum(p.numel() * p.element_size() for p in block.parameters()) for block in layers)
    mesh = init_device_mesh("cpu", (world,))
    for block in layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded = plan_memory(model, 2, 8)
    return (whole.frozen_weights, whole.adapter_weights, whole.optimizer_states, root, layer,
            sharded.frozen_weights, sharded.adapter_weights, sharded.optimizer_states, sharded.notes)


def test_the_memory_plan_counts_a_ranks_fsdp2_shards_and_the_gathered_layers():
    """Under FSDP2 each rank holds half of every parameter (odd dims padded, so about half), plus whole copies of
    the root's parameters and of two decoder layers at the peak (gathered into buffers of their own, beside the
    shards); the adapters and their AdamW states are halved."""
    for result in on_gloo_ranks(_plan_rank):
        assert isinstance(result, tuple), result
        frozen, adapters, states, root, layer, s_frozen, s_adapters, s_states, notes = result
        assert s_adapters == pytest.approx(adapters / 2, rel=0.02) and s_states == pytest.approx(states / 2, rel=0.02)
        assert s_frozen == pytest.approx(frozen / 2 + root + 2 * layer, rel=0.01)   # shards + root + both layers whole
        assert any(note.startswith("FSDP2") for note in notes)

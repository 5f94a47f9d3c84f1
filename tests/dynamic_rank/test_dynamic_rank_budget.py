"""The rank budget's bookkeeping: which forwards count, checkpoints, data parallel ranks."""

from __future__ import annotations

import pytest
import torch

import sits_lora
from sits_lora import DynamicRankCallback, RankBudget
from sits_lora.dynamic_rank import valid_tokens

from test_dynamic_rank import dyn_model, ids, layers

# 3 sequences of 7 tokens, 7 of them valid (5 + 0 + 2)
MASK = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [0] * 7, [1, 1, 0, 0, 0, 0, 0]])
VALID = int(MASK.sum())


def pairs(budget: RankBudget) -> int:
    return budget.read_stats(reset=True)["token_layer_pairs"]


# ---------------------------------------------------------------- which forwards count


def test_padding_tokens_are_left_out_of_the_budget():
    model = dyn_model("learned")
    budget = RankBudget(model)
    model.train()
    model(input_ids=ids(), attention_mask=MASK)
    assert pairs(budget) == VALID * len(layers(model))
    layer = layers(model)[0]
    with valid_tokens(MASK[:, :3]):  # a mask of another shape describes other tokens: every token counts
        layer(torch.randn(3, 7, layer.in_features))
    assert int(layer.rank_counts("default")[0].sum()) == 21


def test_evaluation_and_no_grad_forwards_count_only_while_measuring():
    """A Trainer's evaluation during training must not move λ: only training forwards feed the dual ascent."""
    model = dyn_model("learned")
    budget = RankBudget(model)
    model.eval()
    model(input_ids=ids(), attention_mask=MASK)  # eval mode, autograd on
    with torch.no_grad():
        model(input_ids=ids(), attention_mask=MASK)
    model.train()
    with torch.no_grad():
        model(input_ids=ids(), attention_mask=MASK)
    assert pairs(budget) == 0
    model.eval()
    with budget.measuring(), torch.no_grad():
        model(input_ids=ids(), attention_mask=MASK)
    stats = budget.read_stats()
    assert stats["token_layer_pairs"] == VALID * len(layers(model)) and 2 <= stats["mean_active_rank"] <= 8
    with torch.no_grad():
        model(input_ids=ids())  # the block is over: eval forwards no longer count
    assert pairs(budget) == 0


def test_layers_called_on_their_own_and_earlier_forwards_are_not_counted():
    """The memory plan probes each layer alone in training mode; forwards before the budget existed are not
    its steps."""
    model = dyn_model("learned")
    model.train()
    with pytest.warns(UserWarning, match="without a rank budget"), valid_tokens(None):
        model(input_ids=ids())
    assert int(layers(model)[0].rank_counts("default", reset=False).sum()) > 0
    budget = RankBudget(model)
    assert pairs(budget) == 0
    layer = layers(model)[0]
    layer(torch.randn(2, 5, layer.in_features, requires_grad=True)).sum().backward()
    sits_lora.plan_memory(model, batch_size=2, seq_len=8)
    assert pairs(budget) == 0


def _router_grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() for layer in layers(model) for p in layer.lora_router["default"].parameters()]


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradient_checkpointing_counts_once_and_keeps_the_padding_out_of_the_lambda_term(use_reentrant):
    """Recomputation in backward (gradient checkpointing) neither counts the tokens a second time nor, now that
    the model's valid-token scope is gone, puts the padding into the λ term: the routers' gradients and the
    statistics equal those of the run without checkpointing."""
    results = []
    for checkpointing in (False, True):
        model = dyn_model("learned")
        budget = RankBudget(model)
        budget.load_state_dict({"lam": 0.5, "steps": 0})
        inner = model.base_model.model
        if checkpointing:
            inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
            if use_reentrant:
                inner.enable_input_require_grads()  # reentrant checkpoints need an input that requires grad
        model.train()
        torch.manual_seed(7)  # the routers sample: the same draws in both runs (checkpointing replays the RNG)
        model(input_ids=ids(), attention_mask=MASK, labels=ids()).loss.backward()
        results.append((budget.read_stats(), _router_grads(model)))
    (plain_stats, plain_grads), (ckpt_stats, ckpt_grads) = results
    assert plain_stats["token_layer_pairs"] == ckpt_stats["token_layer_pairs"] == VALID * 6
    assert plain_stats["histogram"] == ckpt_stats["histogram"]
    for plain, ckpt in zip(plain_grads, ckpt_grads):
        torch.testing.assert_close(ckpt, plain, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- checkpoints


def _train(out_dir, resume=None, restore_callback_states=False):
    from transformers import Trainer, TrainingArguments, default_data_collator

    # target at the smallest bucket and a large step: λ is well above 0 after two steps
    model = dyn_model("learned", target_mean_rank=2, rank_budget_step_size=4.0)
    rows = ids(16, 8, seed=5)
    data = [{"input_ids": row, "labels": row, "attention_mask": torch.ones_like(row)} for row in rows]
    args = TrainingArguments(output_dir=str(out_dir), max_steps=4, save_strategy="steps", save_steps=2,
                             per_device_train_batch_size=2, learning_rate=1e-2, report_to="none", use_cpu=True,
                             logging_steps=100, seed=0, restore_callback_states_from_checkpoint=restore_callback_states)
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator,
                      callbacks=[DynamicRankCallback(write_jsonl=False)])
    trainer.train(resume_from_checkpoint=resume)
    # restore_callback_states_from_checkpoint=True replaces the callback with one rebuilt from the checkpoint
    callback = next(c for c in trainer.callback_handler.callbacks if isinstance(c, DynamicRankCallback))
    return {e["step"]: e["rank_lambda"] for e in callback.history}, callback


def test_resumed_run_continues_with_the_saved_lambda(tmp_path):
    full, _ = _train(tmp_path / "full")
    assert sorted(full) == [1, 2, 3, 4] and full[2] > 0
    for restore in (False, True):
        resumed, callback = _train(tmp_path / f"resumed-{restore}", resume=str(tmp_path / "full" / "checkpoint-2"),
                                   restore_callback_states=restore)
        assert sorted(resumed) == [3, 4]
        assert resumed[3] == pytest.approx(full[3], rel=1e-6) and resumed[4] == pytest.approx(full[4], rel=1e-6)
        assert callback.budget.steps == 4 and isinstance(callback.budget, RankBudget)


@pytest.mark.parametrize("mode", ["target", "price"])
def test_callback_state_holds_lambda_and_restores_it(caplog, mode):
    """λ and the step count come back from the checkpoint; with "target" the layers get λ back for their gradient
    term, with "price" they keep 0 (the price itself is in the router biases, restored with the weights)."""
    model = dyn_model("learned", rank_budget_mode=mode)
    callback = DynamicRankCallback(write_jsonl=False)
    assert callback.state() == {"args": {"adapter_name": None, "write_jsonl": False}, "attributes": {"budget": None}}

    class State:
        global_step = 6
        is_world_process_zero = True
        stateful_callbacks = {"DynamicRankCallback": {"args": {}, "attributes": {"budget": {"lam": 0.25, "steps": 6}}}}

    callback.on_train_begin(None, State(), None, model=model)
    assert callback.budget.lam == 0.25 and callback.budget.steps == 6
    assert all(layer.rank_lambda["default"] == (0.25 if mode == "target" else 0.0) for layer in layers(model))
    assert callback.state()["attributes"]["budget"]["lam"] == 0.25
    State.stateful_callbacks = {}  # a checkpoint saved without the callback: λ restarts from 0, and says so
    fresh = DynamicRankCallback(write_jsonl=False)
    fresh.on_train_begin(None, State(), None, model=model)
    assert fresh.budget.lam == 0.0 and "the rank budget's λ restarts from 0" in caplog.text


# ---------------------------------------------------------------- data parallel


def _ddp_worker(rank: int, world: int, port: int, queue):
    import torch.distributed as dist

    try:
        # the parent's intra-op thread pool does not survive fork (a parallel matmul in the child would hang)
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        try:
            model = dyn_model("learned", target_mean_rank=2)
            budget = RankBudget(model, step_size=1.0)
            model.train()
            mask = MASK if rank == 1 else torch.ones_like(MASK)  # the ranks see different tokens
            torch.manual_seed(rank)
            model(input_ids=ids(seed=10 + rank), attention_mask=mask).logits.sum().backward()
            local = torch.stack([layer.rank_counts("default", reset=False) for _, layer in budget.layers])
            stats = budget.step()
            queue.put((rank, local.tolist(), stats["lambda"], stats["token_layer_pairs"]))
        finally:
            dist.destroy_process_group()
    except Exception as error:  # the parent reports it instead of waiting for a result that never comes
        queue.put((rank, None, repr(error), None))


def _lambda_from(counts: torch.Tensor) -> float:
    decided = counts[:, 0].sum(0).double()                                          # (K,)
    mean = float((decided * torch.tensor([2.0, 4.0, 6.0, 8.0], dtype=torch.float64)).sum() / decided.sum())
    return max(0.0, 1.0 * (mean - 2.0) / 8.0)


def test_ranks_sum_their_counts_and_agree_on_lambda():
    """Two gloo ranks (forked processes) route different tokens; λ moves with the counts of both, the same on
    each rank, instead of drifting apart with each rank's own."""
    import multiprocessing
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("fork")  # forked children reuse the imported modules: ~1 s, not ~20 s
    queue = ctx.Queue()
    procs = [ctx.Process(target=_ddp_worker, args=(rank, 2, port, queue)) for rank in range(2)]
    for proc in procs:
        proc.start()
    results = sorted(queue.get(timeout=60) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    assert all(r[1] is not None for r in results), results
    local = [torch.tensor(r[1]) for r in results]                                     # (L, 2, K) per rank
    total = local[0] + local[1]
    assert results[0][3] == results[1][3] == int(total[:, 0].sum())
    assert results[0][2] == results[1][2] == pytest.approx(_lambda_from(total), rel=1e-12)
    assert _lambda_from(local[0]) != _lambda_from(local[1])  # each rank alone would have moved λ elsewhere

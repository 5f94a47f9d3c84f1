"""One rank of the DeepSpeed smoke test (tests/distributed/test_deepspeed.py runs it under torchrun): a tiny Llama
with a sits_lora adapter trained 3 steps by a ZeRO engine of the stage given, this rank's half of the global batch;
writes its losses and its memory plan to OUT/rank<N>.json (two ranks printing at once interleave their lines), then
saves the adapter as the recipe does (every rank gathers, rank 0 writes OUT/adapter).

    torchrun --standalone --nproc_per_node 2 tests/distributed/deepspeed_worker.py STAGE OUT [PERSISTENCE_THRESHOLD]
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import randomize_lora_weights, tiny_llama  # noqa: E402

import deepspeed  # noqa: E402
from peft import get_peft_model  # noqa: E402

from sits_lora import SitsLoraConfig  # noqa: E402
from sits_lora.recipe.train import _save_adapter_atomically  # noqa: E402
from sits_lora.training import plan_memory  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main(stage: int, out: str, persistence=None) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = get_peft_model(tiny_llama(0), SitsLoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                         init_lora_weights=False))
    randomize_lora_weights(model)
    zero = {"stage": stage} if persistence is None else {"stage": stage, "stage3_param_persistence_threshold": persistence}
    config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4 // world, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}}}
    engine, _, _, _ = deepspeed.initialize(model=model.train(), config=config,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])
    ids = torch.randint(0, 97, (4, 8), generator=torch.Generator().manual_seed(3))
    share = 4 // world
    ids = ids[rank * share:(rank + 1) * share]
    losses = []
    for _ in range(3):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    plan = plan_memory(model, share, 8, optimizer="adamw")
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "losses": losses, "plan": plan.to_dict()}, f)
    _save_adapter_atomically(model, os.path.join(out, "adapter"), main_process=rank == 0)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    # DeepSpeed's CPU communication threads abort the interpreter's teardown now and then ("terminate called
    # without an active exception", exit -6) after everything is written: skip the teardown
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], *(int(a) for a in sys.argv[3:]))

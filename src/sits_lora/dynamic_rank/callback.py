"""DynamicRankCallback: the rank budget inside a transformers Trainer, logged every step, saved in checkpoints."""

from __future__ import annotations

import json
import logging
import os
from typing import Optional

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from .budget import RankBudget

RANK_LOG_NAME = "rank_budget.jsonl"

logger = logging.getLogger(__name__)


class DynamicRankCallback(TrainerCallback, ExportableState):
    """Runs :class:`RankBudget` for the Trainer's model: dual ascent after every optimizer step.

    Each step it appends ``{"step", "rank_mean_active", "rank_mean_computed", "rank_lambda",
    "rank_target", "rank_histogram"}`` to ``state.log_history`` (so it lands in trainer_state.json), to
    ``history`` and, one JSON line per step, to ``<output_dir>/rank_budget.jsonl``.

    Checkpoints carry λ and the step count (``trainer_state.json``, under ``stateful_callbacks``), and a
    run resumed with ``resume_from_checkpoint`` continues from them: without λ the budget would restart
    from 0 and the mean rank would overshoot its target until λ had climbed back. With
    ``restore_callback_states_from_checkpoint=True`` the Trainer rebuilds this callback from its
    arguments; a ``budget`` passed in is then rebuilt from the model with the saved target and step size.
    """

    def __init__(self, budget: Optional[RankBudget] = None, adapter_name: Optional[str] = None,
                 write_jsonl: bool = True):
        self.budget = budget
        self.adapter_name = adapter_name
        self.write_jsonl = write_jsonl
        self.history: list[dict] = []
        self._log_path: Optional[str] = None

    def state(self) -> dict:
        budget = self.budget.state_dict() if isinstance(self.budget, RankBudget) else self.budget
        return {"args": {"adapter_name": self.adapter_name, "write_jsonl": self.write_jsonl},
                "attributes": {"budget": budget}}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        # restore_callback_states_from_checkpoint=True rebuilds the callback and sets budget to the saved dict
        saved = self.budget if isinstance(self.budget, dict) else None
        if saved is not None or self.budget is None:
            if model is None:
                raise ValueError("DynamicRankCallback needs the model: the Trainer passes it, or give budget=RankBudget(model)")
            saved = saved or {}
            self.budget = RankBudget(model, adapter_name=self.adapter_name or saved.get("adapter_name"),
                                     step_size=saved.get("step_size"), target_mean_rank=saved.get("target_mean_rank"))
        if state.global_step > 0:
            saved = saved or self._saved_budget(state)
            if saved:
                self.budget.load_state_dict(saved)
            else:
                logger.warning(f"sits_lora: resuming at step {state.global_step} from a checkpoint without a "
                               f"DynamicRankCallback state (saved without this callback, or by an older sits_lora): "
                               f"the rank budget's λ restarts from 0 and the mean active rank may overshoot its "
                               f"target for a while.")
        if self.write_jsonl and state.is_world_process_zero:
            os.makedirs(args.output_dir, exist_ok=True)
            self._log_path = os.path.join(args.output_dir, RANK_LOG_NAME)
        return control

    def _saved_budget(self, state) -> Optional[dict]:
        saved = (state.stateful_callbacks or {}).get(type(self).__name__)
        if isinstance(saved, list):  # several callbacks of this class: the first one's
            saved = saved[0] if saved else None
        if isinstance(saved, dict):
            return saved.get("attributes", {}).get("budget")
        return None

    def on_step_end(self, args, state, control, **kwargs):
        stats = self.budget.step()
        entry = {
            "step": state.global_step,
            # NaN (a step that saw no token) is not JSON: None
            "rank_mean_active": stats["mean_active_rank"] if stats["token_layer_pairs"] else None,
            "rank_mean_computed": stats["mean_computed_rank"] if stats["token_layer_pairs"] else None,
            "rank_lambda": stats["lambda"],
            "rank_target": stats["target_mean_rank"],
            "rank_histogram": {str(k): v for k, v in stats["histogram"].items()},
        }
        self.history.append(entry)
        state.log_history.append(entry)
        if self._log_path is not None:
            with open(self._log_path, "a") as f:
                f.write(json.dumps(entry) + "\n")
        return control

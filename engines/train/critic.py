"""The PPO critic: a Hugging Face backbone with a scalar value head, and its own optimizer.

Values live in response space like log-probs: the value of response slot `t` is read at the
position that predicts token `t` (the state before the action), via the batch's
`logit_index`. The backbone is `AutoModel` (no LM head, so no vocab-sized matmul).

On disk a critic is `{dir}/critic/` = backbone `save_pretrained` + `value_head.pt`, with
`critic_optimizer.pt` / `critic_scheduler.pt` next to the actor's files.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn
from transformers import AutoModel, PreTrainedModel

from engines.train.batching import PaddedBatch

CRITIC_DIR = "critic"
HEAD_FILE = "value_head.pt"


def init_value_head(head: nn.Linear, hidden_size: int, seed: int) -> None:
    """Small init (OpenRLHF's std 1 / (hidden + 1)): initial values near 0, not
    hidden-scale. From its own generator, so every backend (and every TP rank) starts
    from the same head for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        weight = torch.randn(head.weight.shape, generator=gen) / (hidden_size + 1)
        head.weight.copy_(weight.to(head.weight.dtype))
        head.bias.zero_()


class ValueModel(nn.Module):
    def __init__(self, backbone: PreTrainedModel, hidden_size: int, seed: int = 0) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        init_value_head(self.value_head, hidden_size, seed)

    @classmethod
    def from_pretrained(cls, path: str, device: torch.device, seed: int = 0) -> ValueModel:
        """A backbone from an HF model directory; the head too if `path` is a saved critic."""
        backbone = AutoModel.from_pretrained(path, dtype=torch.float32)
        model = cls(backbone, int(backbone.config.hidden_size), seed)
        head = os.path.join(path, HEAD_FILE)
        if os.path.exists(head):
            model.value_head.load_state_dict(torch.load(head, weights_only=True))
        return model.to(device)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """`[B, L]` values, one per position."""
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return self.value_head(out.last_hidden_state).squeeze(-1).float()

    def save(self, local_dir: str, state: dict[str, Tensor] | None = None) -> None:
        """The critic under `local_dir/critic/`; from `state` (this model's whole state
        dict, as a sharded trainer gathers it) instead of its own tensors when given."""
        path = os.path.join(local_dir, CRITIC_DIR)
        os.makedirs(path, exist_ok=True)
        if state is None:
            self.backbone.save_pretrained(path)
            torch.save(self.value_head.state_dict(), os.path.join(path, HEAD_FILE))
            return
        parts: dict[str, dict[str, Tensor]] = {"backbone": {}, "value_head": {}}
        for name, tensor in state.items():
            part, _, key = name.partition(".")
            parts[part][key] = tensor.detach().cpu()
        self.backbone.save_pretrained(path, state_dict=parts["backbone"])
        torch.save(parts["value_head"], os.path.join(path, HEAD_FILE))


def response_values(model: nn.Module, batch: PaddedBatch) -> Tensor:
    """`[B, R]` values at the positions that predict each response token."""
    values = model(batch.input_ids, batch.attention_mask)
    rows = torch.arange(values.shape[0], device=values.device).unsqueeze(-1)
    return values[rows, batch.logit_index]

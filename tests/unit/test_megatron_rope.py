"""`engines/train/megatron/rope.py`: RoPE over packed sequences in one pass against a
rotation written out pair by pair for each sequence alone (no megatron needed)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from engines.train.megatron.rope import packed_rope, positions_in_sequence

LENGTHS = [5, 37, 1, 0, 20]  # ragged, a one-token and an empty sequence
HEADS, DIM = 3, 16


def _inv_freq(rot: int) -> Tensor:
    return 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))


def _table(rows: int, rot: int, interleaved: bool) -> Tensor:
    """megatron's `[rows, 1, 1, rot]` angle table: each frequency for both halves, or
    twice in a row (interleaved)."""
    f = torch.outer(torch.arange(rows, dtype=torch.float64), _inv_freq(rot))
    f = f.repeat_interleave(2, dim=-1) if interleaved else torch.cat((f, f), dim=-1)
    return f[:, None, None, :]


def _rotate_alone(x: Tensor, rot: int, interleaved: bool) -> Tensor:
    """One sequence `[s, heads, d]` at positions 0..s-1: each pair of its first `rot`
    channels, (i, i + rot/2) or (2i, 2i + 1), turned by position x frequency i."""
    angle = torch.outer(torch.arange(x.shape[0], dtype=x.dtype), _inv_freq(rot))[:, None, :]
    cos, sin = torch.cos(angle), torch.sin(angle)
    if interleaved:
        a, b = x[..., 0:rot:2], x[..., 1:rot:2]
        turned = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    else:
        a, b = x[..., : rot // 2], x[..., rot // 2 : rot]
        turned = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    return torch.cat((turned, x[..., rot:]), dim=-1)


def _reference(t: Tensor, lengths: list[int], rot: int, interleaved: bool) -> Tensor:
    return torch.cat([_rotate_alone(x, rot, interleaved) for x in t.split(lengths)])


def _cu(lengths: list[int]) -> Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def test_positions_restart_in_each_sequence() -> None:
    assert positions_in_sequence(_cu([3, 0, 2, 1]), 6).tolist() == [0, 1, 2, 0, 1, 0]


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rot", [DIM, DIM // 2])  # all channels, or rotary_percent 0.5
def test_matches_each_sequence_rotated_alone(interleaved: bool, rot: int) -> None:
    """Outputs and gradients, float64."""
    torch.manual_seed(0)
    t = torch.randn(sum(LENGTHS), HEADS, DIM, dtype=torch.float64, requires_grad=True)
    out = packed_rope(t, _cu(LENGTHS), _table(max(LENGTHS), rot, interleaved), interleaved)
    ref = _reference(t, LENGTHS, rot, interleaved)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    g = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, t, g)
    (ref_grad,) = torch.autograd.grad(ref, t, g)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("interleaved", [False, True])
def test_positions_running_on_across_sequences_are_caught(interleaved: bool) -> None:
    """The comparison above can fail: the same tokens as one long sequence (positions
    running on past each sequence's end) differ from the reference."""
    torch.manual_seed(0)
    total = sum(LENGTHS)
    t = torch.randn(total, HEADS, DIM, dtype=torch.float64)
    table = _table(total + 1, DIM, interleaved)
    run_on = packed_rope(t, _cu([total]), table, interleaved)
    assert not torch.allclose(run_on, _reference(t, LENGTHS, DIM, interleaved))


def test_bfloat16_rounds_as_megatron() -> None:
    """bf16 as megatron computes it: float32 angles, cos/sin rounded to bf16, bf16 products."""
    torch.manual_seed(0)
    t = torch.randn(sum(LENGTHS), HEADS, DIM, dtype=torch.bfloat16)
    table = _table(max(LENGTHS), DIM, False).float()
    out = packed_rope(t, _cu(LENGTHS), table)
    ref = _reference(t.double(), LENGTHS, DIM, False)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=0.05)


def test_a_table_row_per_token_is_read_per_token() -> None:
    """megatron's rule: a table with as many rows as tokens gives each token its own row."""
    torch.manual_seed(0)
    total = sum(LENGTHS)
    t = torch.randn(total, HEADS, DIM, dtype=torch.float64)
    out = packed_rope(t, _cu(LENGTHS), _table(total, DIM, False))
    torch.testing.assert_close(out, _reference(t, [total], DIM, False), rtol=0, atol=1e-12)

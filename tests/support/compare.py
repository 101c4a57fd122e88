"""What a fault test compares with its uninterrupted reference run: every committed step's
trained samples field by field, and the final weights where the test promises them. The
fault matrix's "samples identical" column is `RunComparison.identical`, never a literal."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load_file

from storage.batch_io import read_samples
from storage.run_layout import RunLayout
from storage.sample import Sample

MAX_SHOWN = 8  # differences listed in the message; the count says how many there were


@dataclass
class RunComparison:
    """`identical` only when something was compared (a run with no committed step, or no
    sample, matches nothing) and no field of any sample (or weight) differed."""

    steps: list[int]
    samples: int = 0
    weights: int = 0  # tensors compared
    differences: list[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return self.samples > 0 and not self.differences

    def __str__(self) -> str:
        head = (f"steps {self.steps}, {self.samples} samples, {self.weights} weight tensors: "
                f"{'identical' if self.identical else f'{len(self.differences)} differences'}")
        if self.samples == 0:
            head += " (nothing compared)"
        shown = self.differences[:MAX_SHOWN]
        more = len(self.differences) - len(shown)
        return "\n  ".join([head, *shown] + ([f"... and {more} more"] if more > 0 else []))


def _layout(cfg: Any) -> RunLayout:
    return RunLayout.open(cfg.storage.uri, cfg.storage.run_name, cfg.storage.endpoint_url,
                          cfg.storage.storage_options)


def _reward(sample: Sample) -> Any:
    r = sample.reward
    return {k: _nan_safe(v) for k, v in r.items()} if isinstance(r, dict) else _nan_safe(r)


def _nan_safe(v: float | None) -> Any:
    return "nan" if isinstance(v, float) and math.isnan(v) else v


def sample_fields(s: Sample) -> dict[str, Any]:
    """What must match between two runs' trained samples."""
    return {"index": s.index, "group_index": s.group_index,
            "prompt_tokens": s.prompt_tokens, "response_tokens": s.response_tokens,
            "reward": _reward(s), "loss_mask": s.loss_mask}


def _compare_steps(ref: RunLayout, got: RunLayout, out: RunComparison) -> None:
    want_steps = ref.committed_steps()
    if out.steps != want_steps:
        out.differences.append(f"committed steps {out.steps}, reference {want_steps}")
    for k in sorted(set(out.steps) & set(want_steps)):
        a = read_samples(ref.store, f"steps/{k:06d}", "train.arrow")
        b = read_samples(got.store, f"steps/{k:06d}", "train.arrow")
        if len(a) != len(b):
            out.differences.append(f"step {k}: {len(b)} samples, reference {len(a)}")
        for i, (sa, sb) in enumerate(zip(a, b, strict=False)):
            fa, fb = sample_fields(sa), sample_fields(sb)
            for name in fa:
                if fa[name] != fb[name]:
                    out.differences.append(
                        f"step {k} sample #{i} (index {sb.index}): {name} {fb[name]!r:.80} "
                        f"!= reference {fa[name]!r:.80}")
        out.samples += min(len(a), len(b))


def _compare_weights(ref: RunLayout, got: RunLayout, files: tuple[str, ...], rtol: float,
                     atol: float, out: RunComparison) -> None:
    last = max(ref.committed_steps(), default=None)
    if last is None:
        out.differences.append("reference has no committed step: no weights to compare")
        return
    for name in files:
        paths = [os.path.join(lay.uri, "checkpoints", f"{last:06d}", name) for lay in (ref, got)]
        if not os.path.exists(paths[1]):
            out.differences.append(f"checkpoint {last:06d}/{name} missing")
            continue
        want, have = (load_file(p) for p in paths)
        if want.keys() != have.keys():
            out.differences.append(f"{name}: tensor names differ")
        for key in sorted(want.keys() & have.keys()):
            out.weights += 1
            a, b = want[key], have[key]
            same = (torch.equal(a, b) if rtol == atol == 0.0
                    else a.shape == b.shape and torch.allclose(b, a, rtol=rtol, atol=atol))
            if not same:
                delta = (b.float() - a.float()).abs().max().item() if a.shape == b.shape else None
                out.differences.append(f"{name}:{key} differs (max abs {delta})")


def compare_runs(
    reference_cfg: Any, cfg: Any, *, weights: tuple[str, ...] = (), rtol: float = 0.0,
    atol: float = 0.0,
) -> RunComparison:
    """Compare `cfg`'s run with `reference_cfg`'s: the same committed steps, and per step the
    trained samples' index, group, prompt and response tokens, reward and loss mask, in
    order; with `weights` (file names in the last checkpoint, e.g. "model.safetensors"),
    every tensor of those files, bit for bit unless `rtol`/`atol` are given."""
    ref, got = _layout(reference_cfg), _layout(cfg)
    out = RunComparison(steps=got.committed_steps())
    _compare_steps(ref, got, out)
    if weights:
        _compare_weights(ref, got, weights, rtol, atol, out)
    return out

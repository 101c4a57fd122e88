"""The TRL side of `bench.vs_trl`: GRPOTrainer on the arithmetic task, snapshotting the
policy at fixed sample counts, and the greedy exact-match evaluator both sides are scored by.

TRL (`pip install -e .[bench]`) is imported lazily: rollflow never depends on it.

Why these settings: `bf16=False, gradient_checkpointing=False` because GRPOConfig's defaults
(bf16 autocast, checkpointing) are made for GPUs and run far slower on a CPU (bench/RESULTS.md,
"vs TRL"); everything else
is TRL's default (AdamW, linear LR decay, loss_type, scale_rewards, no KL) except what the task
fixes: 8 completions per prompt, at most `max_completion_length` new tokens, temperature 1.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from engines.rollout.rewards.text_rules import exact_match_score


@dataclass(slots=True)
class Snapshot:
    """The policy after `samples` training samples, `seconds` (wall) and `cpu` (process CPU
    seconds, all threads) into training, snapshot costs excluded."""

    samples: int
    seconds: float
    cpu: float
    state: dict[str, Tensor] = field(repr=False)


@dataclass(frozen=True, slots=True)
class TrlRun:
    lr: float
    steps: int
    samples_per_step: int
    snapshots: list[Snapshot]
    seconds: float  # whole trainer.train() call, snapshots excluded
    cpu: float


def read_rows(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def greedy_completions(
    model: Any, tokenizer: Any, prompts: list[str], max_new_tokens: int, batch_size: int = 500,
) -> list[str]:
    """`prompts`' greedy completions: at most `max_new_tokens`, stopping at EOS, special
    tokens dropped, generated on the model's device."""
    model.eval()
    tokenizer.padding_side = "left"
    texts: list[str] = []
    for start in range(0, len(prompts), batch_size):
        enc = tokenizer(prompts[start : start + batch_size], return_tensors="pt", padding=True,
                        add_special_tokens=False).to(model.device)
        with torch.no_grad():
            out = model.generate(
                **enc, do_sample=False, max_new_tokens=max_new_tokens,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            )
        texts += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :],
                                        skip_special_tokens=True)
    return texts


def greedy_accuracy(
    model: Any, tokenizer: Any, rows: list[dict[str, Any]], max_new_tokens: int,
    batch_size: int = 500, score: Callable[[str, str], float] = exact_match_score,
) -> float:
    """Mean `score` (rollflow's `exact_match` rule by default) of `rows`' greedy completions
    (`greedy_completions`) against their labels."""
    texts = greedy_completions(model, tokenizer, [r["prompt"] for r in rows], max_new_tokens,
                               batch_size)
    return sum(score(t, r["label"]) for t, r in zip(texts, rows, strict=True)) / len(rows)


def _snapshot_callback(every_steps: int, samples_per_step: int) -> Any:
    from transformers import TrainerCallback

    class Snapshots(TrainerCallback):  # type: ignore[misc]
        """Copies the weights every `every_steps` optimizer steps; the copy's own time is
        taken off the clock so it does not count against TRL."""

        def __init__(self) -> None:
            self.snapshots: list[Snapshot] = []
            self.t0 = self.c0 = self.paused = self.cpu_paused = 0.0

        def elapsed(self) -> tuple[float, float]:
            return (time.perf_counter() - self.t0 - self.paused,
                    time.process_time() - self.c0 - self.cpu_paused)

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            last = state.global_step == state.max_steps
            if state.global_step % every_steps and not last:
                return
            t, c = time.perf_counter(), time.process_time()
            seconds, cpu = self.elapsed()
            weights = {k: v.detach().clone() for k, v in kw["model"].state_dict().items()}
            self.snapshots.append(
                Snapshot(state.global_step * samples_per_step, seconds, cpu, weights))
            self.paused += time.perf_counter() - t
            self.cpu_paused += time.process_time() - c

    return Snapshots()


def run_trl(
    sft_ckpt: str, train_rows: list[dict[str, Any]], *, lr: float, steps: int,
    snapshot_every: int, samples_per_step: int = 64, num_generations: int = 8,
    max_completion_length: int = 4, seed: int = 42, num_iterations: int = 1,
) -> TrlRun:
    """GRPOTrainer from `sft_ckpt` for `steps` optimizer steps of `samples_per_step`
    completions (`samples_per_step / num_generations` prompts each); `num_iterations` > 1
    reuses each generation batch that many times (TRL's PPO epochs)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    if snapshot_every % samples_per_step:
        raise ValueError(f"snapshot every {snapshot_every} samples: not a multiple of TRL's "
                         f"{samples_per_step} samples per step")

    def exact_match(completions: list[str], label: list[str], **_: Any) -> list[float | None]:
        return [exact_match_score(c, lab) for c, lab in zip(completions, label, strict=True)]

    model = AutoModelForCausalLM.from_pretrained(sft_ckpt, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(sft_ckpt)
    data = Dataset.from_list([{"prompt": r["prompt"], "label": r["label"]} for r in train_rows])
    # with num_iterations = k, k optimizer steps see the same generated samples
    callback = _snapshot_callback(snapshot_every * num_iterations // samples_per_step,
                                  samples_per_step // num_iterations)
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as out:
        config = GRPOConfig(
            output_dir=out, learning_rate=lr, max_steps=steps,
            per_device_train_batch_size=samples_per_step, num_generations=num_generations,
            max_completion_length=max_completion_length, temperature=1.0,
            bf16=False, gradient_checkpointing=False, use_cpu=True, seed=seed,
            num_iterations=num_iterations,
            report_to=[], save_strategy="no", logging_steps=max(steps // 10, 1),
            disable_tqdm=True, dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=config,
                              train_dataset=data, processing_class=tokenizer,
                              callbacks=[callback])
        trainer.remove_callback(PrinterCallback)  # a metrics dict per logging step
        trainer.train()
        seconds, cpu = callback.elapsed()
    return TrlRun(lr, steps, samples_per_step, callback.snapshots, seconds, cpu)


def evaluate_states(
    sft_ckpt: str, states: list[Callable[[], dict[str, Tensor]]], rows: list[dict[str, Any]],
    max_new_tokens: int,
) -> list[float]:
    """Greedy accuracy of each state dict (loaded lazily) on one model of `sft_ckpt`'s shape."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(sft_ckpt, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(sft_ckpt)
    out = []
    for load in states:
        model.load_state_dict(load())
        out.append(greedy_accuracy(model, tokenizer, rows, max_new_tokens))
    return out

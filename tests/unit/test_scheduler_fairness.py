"""Control calls act between two steps of a running request.

A loop that releases the step lock and takes it again at once starves them: with two
engines busy on two cores an abort waited until whole requests had ended (1 run in 4 of the partial
rollout test, which these unit tests do not reproduce on an idle machine)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future

from engines.inference.decode_batch import DecodeBatch
from engines.inference.embedded_generator import EmbeddedGenerator
from engines.inference.gen_types import GenRequest, GenResult, SamplingParams
from engines.inference.scheduler import ContinuousScheduler

TOKENS = 100


class SlowSteps(EmbeddedGenerator):
    """Each step holds the step lock 3 ms longer with the GIL released, as the compiled
    engine's turns of several tokens do."""

    def step(self, batch: DecodeBatch, admit: Sequence[GenRequest]) -> list[GenResult]:
        time.sleep(0.003)
        return super().step(batch, admit)


def running(model_dir: str) -> tuple[ContinuousScheduler, Future[list[GenResult]]]:
    """A scheduler decoding one request of 100 tokens (~0.4 s), 0.1 s after it started."""
    scheduler = ContinuousScheduler(SlowSteps(model_dir, num_threads=1, device="cpu"))
    scheduler.start()
    params = SamplingParams(max_new_tokens=TOKENS, ignore_eos=True, temperature=0.0)
    future = scheduler.submit([GenRequest("long", [1, 2, 3], params)])
    time.sleep(0.1)
    return scheduler, future


def test_an_abort_lands_between_two_steps_not_after_the_request(tiny_model_dir: str) -> None:
    scheduler, future = running(tiny_model_dir)
    try:
        scheduler.abort("long")
        (result,) = future.result(timeout=30)
        assert result.finish_reason["type"] == "abort"
        assert 0 < len(result.output_ids) < TOKENS / 2
    finally:
        scheduler.stop()


def test_a_weight_update_lands_between_two_steps(tiny_model_dir: str) -> None:
    scheduler, future = running(tiny_model_dir)
    try:
        landed: list[bool] = []
        update = threading.Thread(target=lambda: landed.append(
            scheduler.between_steps(future.done)))
        update.start()
        update.join(timeout=30)
        assert landed == [False]  # it ran while the request was still decoding
    finally:
        scheduler.abort("", abort_all=True)
        scheduler.stop()

"""Queued requests join a running batch in chunks (an eighth of the batch), not one by one as
rows end: each join copies the running KV cache (bench/RESULTS.md, "Group journal")."""

from __future__ import annotations

from collections.abc import Sequence

from engines.inference.gen_types import GenRequest, GenResult, SamplingParams
from engines.inference.scheduler import ContinuousScheduler


class CountdownBatch(list):  # type: ignore[type-arg]
    """Running requests with the steps each has left."""

    @property
    def num_running(self) -> int:
        return len(self)


class CountdownGenerator:
    """Each request runs `max_new_tokens` steps; records how many requests each step admits."""

    weight_version = 0

    def __init__(self) -> None:
        self.admitted: list[int] = []

    def new_batch(self) -> CountdownBatch:
        return CountdownBatch()

    def step(self, batch: CountdownBatch, admit: Sequence[GenRequest]) -> list[GenResult]:
        self.admitted.append(len(admit))
        batch.extend([r, r.params.max_new_tokens] for r in admit)
        for row in batch:
            row[1] -= 1
        ended = [r for r, left in batch if left <= 0]
        batch[:] = [row for row in batch if row[1] > 0]
        return [GenResult(r.rid, [1] * r.params.max_new_tokens, [-0.1] * r.params.max_new_tokens,
                          "", {"type": "length"}, 1, 0) for r in ended]


def test_queued_requests_join_a_running_batch_an_eighth_at_a_time() -> None:
    generator = CountdownGenerator()
    scheduler = ContinuousScheduler(generator, max_batch_size=16)  # type: ignore[arg-type]
    scheduler.start()
    try:
        # rows of 1..40 steps: one ends at almost every step once the batch is full
        requests = [GenRequest(f"r{i}", [1], SamplingParams(max_new_tokens=1 + i))
                    for i in range(40)]
        results = scheduler.submit(requests).result(timeout=60)
    finally:
        scheduler.stop()
    assert [r.rid for r in results] == [f"r{i}" for i in range(40)]
    joins = [n for n in generator.admitted[1:] if n]
    assert generator.admitted[0] == 16 and sum(generator.admitted) == 40
    assert all(n >= 2 for n in joins[:-1]), generator.admitted  # 16 // 8, the last may be less

"""The `engine` section: what each inference engine serves and how (embedded, SGLang or mock)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_serializer, model_validator

from storage.config import Section
from storage.secrets import redact_url


class EngineConfig(Section):
    backend: Literal["embedded", "sglang", "mock"] = Field(
        "embedded", description="Rollout engine: embedded (torch), sglang (HTTP), mock."
    )
    model_path: str | None = Field(None, description="HF-format model directory.")
    num_engines: int = Field(1, ge=1)
    standby_engines: int = Field(
        0, ge=0,
        description="Engines started and loaded beside the pool that serve nothing until one "
        "of the pool's engines is lost: one then takes its place at once (its weights copied "
        "from a survivor), and a new standby starts in the background. Each costs what an "
        "engine costs (memory, a GPU or a core's share): with placement, a bundle of its own "
        "(cluster.rollout_num_gpus must hold the pool and the standbys). Embedded and mock "
        "engines. Its speed: bench/RESULTS.md, \"Engine replacement\".",
    )
    host: str = Field("127.0.0.1", description="Interface the embedded HTTP server binds.")
    urls: list[str] = Field(
        default_factory=list, repr=False, description="External SGLang server URLs."
    )

    @field_serializer("urls")
    def _redact_urls(self, urls: list[str]) -> list[str]:
        return [redact_url(u) or u for u in urls]
    max_batch_size: int = Field(1024, ge=1, description="Requests decoded together.")
    dtype: Literal["float32", "bfloat16", "float16", "fp8"] = Field(
        "float32",
        description="The model's dtype (bfloat16 on GPUs). fp8: FP8 rollouts, the decoder "
        "layers' projections in float8 (e4m3) with per-row weight scales and inputs "
        "quantized per row as they arrive, the rest bfloat16 (SGLang: --quantization fp8 "
        "with --dtype bfloat16). About half the weight memory and, on an H100, float8 "
        "matmuls; the engine's log-probs then differ more from the trainer's (reported as "
        "train/rollout_logprob_abs_diff; algorithm.rollout_correction corrects for it).",
    )
    num_continuous_decode_steps: int = Field(
        8, ge=1,
        description="Embedded engine: tokens decoded per scheduler turn without returning to "
        "Python (SGLang's --num-continuous-decode-steps, whose default is 1). Admissions, aborts "
        "and weight updates wait for the turn to end; a turn ends early when a row finishes. "
        "Used by the compiled CPU step, for rows without stop strings or top-p/top-k.",
    )
    disable_cuda_graph: bool = Field(
        False,
        description="Embedded engine on a GPU: decode every step from Python instead of "
        "replaying a captured CUDA graph of it (SGLang's --disable-cuda-graph).",
    )
    enable_torch_compile: bool = Field(
        False,
        description="Embedded engine on a GPU: run the captured decode step's layers "
        "through torch.compile (SGLang's --enable-torch-compile); the first batch waits for "
        "the compile. Its effect: bench/RESULTS.md, \"Embedded engine vs HF generate on a GPU\".",
    )
    batch_invariant: bool | None = Field(
        None,
        description="Embedded engine: compute each request's logits and log-probs in a fixed "
        "order of its own (prefill a token at a time through the compiled decode step, no "
        "batched matmuls), so they do not depend on which requests share a batch; float32 "
        "Llama-layout models on the CPU (elsewhere a warning, and batched kernels). Default "
        "(null): train.deterministic. Its cost: bench/RESULTS.md, \"Deterministic mode\".",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="Embedded engine: auto puts the model on the GPU the engine's process "
        "sees (an engine placed on a GPU bundle sees its own GPU), else on the CPU.",
    )
    mock_token_seconds: float = Field(
        0.0, ge=0.0,
        description="Mock backend: wall time each generated token takes, slept, not computed "
        "(0: answers at once). A fault test's requests then stay in flight for a known "
        "time at no CPU, where a real model would need seconds of decoding.",
    )
    expert_parallel: int = Field(
        1, ge=1,
        description="SGLang engines, MoE models: expert-parallel size inside one engine "
        "(SGLang's --ep-size), dividing its GPUs (cluster.rollout_num_gpus_per_engine). "
        "The embedded engine holds every expert on one device and refuses more than 1.",
    )

    @model_validator(mode="after")
    def _check_engine(self) -> EngineConfig:
        if self.expert_parallel > 1 and self.backend != "sglang":
            raise ValueError(
                f"engine.expert_parallel={self.expert_parallel}: the {self.backend} engine "
                "holds every expert on one device; expert parallelism in rollout needs "
                "engine.backend: sglang (its --ep-size)"
            )
        return self

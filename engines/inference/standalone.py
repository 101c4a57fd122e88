"""The embedded engine on its own, as `python -m sglang.launch_server` runs SGLang:
`rollflow engine --model-path PATH --port N`.

The same generator, scheduler and app an engine actor serves, in the foreground: SGLang's
native API (`/generate`, weight updates, ...) and its OpenAI-compatible routes, for an agent
developed against it, a client test, or an evaluation outside training. Flags keep SGLang's
names; the ones that ask for what one embedded engine cannot do (tensor or expert
parallelism) are refused by name.
"""

from __future__ import annotations

import argparse
import sys

from engines.config.engine import EngineConfig


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """SGLang's `launch_server` flags, the subset this engine implements."""
    p.add_argument("--model-path", required=True, help="HF-format model directory")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=30000, help="port to listen on (default 30000)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id /v1/models lists (default: the model path)")
    p.add_argument("--tool-call-parser", default="hermes",
                   help="tool-call format of /v1/chat/completions: hermes, qwen25 or qwen")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on a GPU, float32 on the CPU")
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="fp8: the decoder layers' projections in float8, the rest bfloat16 "
                   "(overrides --dtype)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: cuda when a GPU is visible, else cpu")
    p.add_argument("--max-running-requests", type=int, default=1024,
                   help="requests decoded together")
    p.add_argument("--num-continuous-decode-steps", type=int, default=8,
                   help="decode steps run between two scheduling rounds (default 8)")
    p.add_argument("--random-seed", type=int, default=0, help="seed of the sampling")
    p.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1,
                   help="tensor-parallel degree (default 1)")
    p.add_argument("--ep-size", "--expert-parallel-size", type=int, default=1,
                   help="expert-parallel degree of an MoE model (default 1)")
    p.add_argument("--log-level", default="info", help="debug, info, warning or error")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    for flag, value in (("--tp-size", args.tp_size), ("--ep-size", args.ep_size)):
        if value != 1:
            raise ValueError(f"{flag} {value}: the embedded engine runs one model on one device; "
                             "serve tensor or expert parallel models with SGLang")
    dtype = "fp8" if args.quantization == "fp8" else args.dtype
    if dtype == "auto":
        import torch

        on_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        dtype = "bfloat16" if on_gpu else "float32"
    return EngineConfig(backend="embedded", model_path=args.model_path, host=args.host,
                        max_batch_size=args.max_running_requests, dtype=dtype,
                        device=args.device,
                        num_continuous_decode_steps=args.num_continuous_decode_steps)


def serve(args: argparse.Namespace) -> int:
    """Load the model, then serve until interrupted (imports here: the CLI's other
    commands do not pay for torch and uvicorn)."""
    import uvicorn

    from engines.inference.engine_actor import build_generator
    from engines.inference.scheduler import ContinuousScheduler
    from engines.inference.sglang_server import create_app
    from engines.process import actor_threads

    config = engine_config(args)
    generator = build_generator(config, args.random_seed, actor_threads(None))
    scheduler = ContinuousScheduler(generator, max_batch_size=config.max_batch_size)
    app = create_app(generator, scheduler, args.served_model_name, args.tool_call_parser)
    print(f"rollflow engine: {args.model_path} at http://{args.host}:{args.port} "
          f"(OpenAI base URL http://{args.host}:{args.port}/v1)", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                access_log=False)
    return 0

"""`python -m sglang_router.launch_router`'s start of the Rust router, without the import of
its Python load balancer (`mini_lb`: fastapi, aiohttp and uvicorn, about 0.6 CPU-s of the
router process's 0.7-0.9 on this project's 2-core machine; every run with a router starts
one). The arguments, their parsing and the router are sglang-router's own; only `--mini-lb`,
which rollflow never passes, is refused. Figures: bench/RESULTS.md, "CI cost".

    python -m engines.rollout.router_process --host 127.0.0.1 --port 30000 --policy ...
"""

from __future__ import annotations

import argparse
import sys

import setproctitle
from sglang_router.router import Router
from sglang_router.router_args import RouterArgs


def parse_router_args(argv: list[str]) -> RouterArgs:
    """As `sglang_router.launch_router.parse_router_args`."""
    parser = argparse.ArgumentParser(prog="sglang-router")
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    return RouterArgs.from_cli_args(parser.parse_args(argv), use_router_prefix=False)


def main(argv: list[str] | None = None) -> None:
    """As `sglang_router.launch_router.launch_router` for the Rust router: it serves until
    the process is stopped."""
    router_args = parse_router_args(sys.argv[1:] if argv is None else argv)
    if router_args.mini_lb:
        raise SystemExit("--mini-lb: use python -m sglang_router.launch_router")
    setproctitle.setproctitle("sglang::router")
    router_args._validate_router_args()
    Router.from_args(router_args).start()


if __name__ == "__main__":
    main()

"""`rollflow` command line: train, replay, server, cluster up|down|status, runs list|show."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from flows.config import ConfigError


def _prefect_env() -> None:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")


def cmd_train(args: argparse.Namespace) -> int:
    from flows.config_loader import load_config

    _prefect_env()
    cfg = load_config(args.config, args.set)
    from flows.train import train

    result = train(cfg)
    print(json.dumps({k: v for k, v in result.items() if k != "evals"}, indent=1, default=str))
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from flows.replay import parse_steps, replay, replay_config
    from storage.object_store import open_store

    _prefect_env()
    steps = parse_steps(args.steps)
    source = open_store(args.root, args.endpoint_url).child(args.run)
    if not source.exists("config.yaml"):
        print(f"no run {args.run!r} under {args.root}", file=sys.stderr)
        return 1
    cfg = replay_config(source.read_text("config.yaml"), args.root, args.run, steps, args.set,
                        args.endpoint_url)
    result = replay(cfg, args.run, *steps)
    print(json.dumps({k: v for k, v in result.items() if k != "evals"}, indent=1, default=str))
    return 0


def cmd_server(args: argparse.Namespace) -> int:
    from flows.server import serve_forever

    return serve_forever(args.host, args.port, args.home)


def cmd_cluster(args: argparse.Namespace) -> int:
    from flows import cluster
    from flows.config import ClusterConfig

    cfg = ClusterConfig(address=args.address)
    if args.action == "up":
        print(cluster.cluster_address(cfg, start=True))
    elif args.action == "down":
        print("stopped" if cluster.stop_local_head() else "no local cluster recorded")
    else:
        print(json.dumps(cluster.status(cfg), indent=1))
    return 0


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


RUN_COLUMNS = ("rollout_id", "reward/mean", "train/loss", "time/generate", "time/train")


def cmd_runs(args: argparse.Namespace) -> int:
    from storage.object_store import open_store
    from storage.run_layout import RunLayout

    root = open_store(args.root, args.endpoint_url)
    if args.action == "list":
        for name in root.list():
            layout = RunLayout(root.child(name))
            if not layout.store.exists("config.yaml"):
                continue
            steps = layout.committed_steps()
            evals = layout.evals()
            last_eval = evals[max(evals)] if evals else {}
            print(f"{name}\tsteps={len(steps)}\t" + " ".join(
                f"{k}={_fmt(v)}" for k, v in last_eval.items() if k.count("/") == 1
            ))
        return 0
    layout = RunLayout(root.child(args.run))
    if not layout.store.exists("config.yaml"):
        print(f"no run {args.run!r} under {args.root}", file=sys.stderr)
        return 1
    print("\t".join(RUN_COLUMNS))
    for k in layout.committed_steps():
        m = layout.step_metrics(k)
        print("\t".join(_fmt(m.get(c, "")) for c in RUN_COLUMNS))
    for version, ev in sorted(layout.evals().items()):
        print(f"eval@v{version}\t" + " ".join(f"{k}={_fmt(v)}" for k, v in ev.items()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="run (or resume) the train flow")
    p.add_argument("--config", required=True, help="YAML config file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override, e.g. rollout.num_rollout=4 (repeatable)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("replay", help="train again on the saved batches of a run, no engines")
    p.add_argument("run", help="source run under --root")
    p.add_argument("--steps", required=True, help="A:B, the rollout ids A..B-1 to replay")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override of the source run's config (new run: <run>-replay-A-B)")
    p.add_argument("--root", default="./runs", help="storage root of the runs")
    p.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint")
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("server", help="a Prefect server with its UI on 127.0.0.1")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=4200)
    p.add_argument("--home", default=None, help="PREFECT_HOME of the server (its database)")
    p.set_defaults(func=cmd_server)

    p = sub.add_parser("cluster", help="the persistent local Ray cluster")
    p.add_argument("action", choices=["up", "down", "status"])
    p.add_argument("--address", default=None)
    p.set_defaults(func=cmd_cluster)

    p = sub.add_parser("runs", help="runs in a storage root")
    p.add_argument("action", choices=["list", "show"])
    p.add_argument("run", nargs="?")
    p.add_argument("--root", default="./runs")
    p.add_argument("--endpoint-url", default=None)
    p.set_defaults(func=cmd_runs)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "runs" and args.action == "show" and not args.run:
        build_parser().error("runs show needs RUN")
    try:
        return int(args.func(args))
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

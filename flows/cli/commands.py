"""`rollflow` command line: train (or resume) a run, replay its saved batches, a Prefect
server, an inference engine on its own (`engine`), the local Ray cluster (`cluster
up|down|status`), the runs in a storage root (`runs list|show|stop`) and a training's engine
pool (`engines add|remove|show`). `rollflow COMMAND -h` tells more."""

from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import nullcontext, redirect_stdout
from typing import Any, TextIO

from engines.inference.standalone import add_engine_arguments
from flows.cli.errors import quiet_prefect_failures, report_failure, run_dir_of
from flows.servers.prefect_env import prefect_env_defaults


def _user_code_importable() -> None:
    """Hooks named in a config (`myreward:score`) import from the directory the command
    was run from, as with `python -m`; actors get the same directory (engines.cluster.registry)."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def cmd_train(args: argparse.Namespace) -> int:
    from flows.bookkeeping.start_lines import phase, stop_telling
    from flows.config.loader import load_config

    prefect_env_defaults()
    _user_code_importable()
    cfg = load_config(args.config, args.set)
    if args.fresh and not start_over(cfg):
        return 1
    phase(f"run {cfg.storage.run_name}: checking the config, the data and the model")
    from flows.bookkeeping.preflight import preflight_once

    preflight_once(cfg)  # before Prefect starts: a mistake fails in seconds
    from engines.cluster.head import head_starting
    from flows.servers.prefect_server import local_prefect_api
    from flows.train import train

    try:
        with head_starting(cfg.cluster), local_prefect_api():
            result = train(cfg)
    finally:
        stop_telling()
    _print_result(result, args.result_out)
    return 0


def start_over(cfg: Any) -> bool:
    """`train --fresh`: delete the run directory (after a yes, on a terminal) and the run's
    actors, which hold its weights; refused while a driver trains the run."""
    from engines.cluster.actors import kill_run_actors
    from engines.cluster.head import cluster_address, connect
    from flows.bookkeeping.driver_record import read_record
    from storage.run_layout import RunLayout

    s = cfg.storage
    layout = RunLayout.open(s.uri, s.run_name, s.endpoint_url, s.store_options())
    if not layout.store.exists():
        return True
    driver = read_record(layout)
    if driver is not None and driver.running():
        print(f"--fresh: run {s.run_name} is being trained by pid {driver.pid}; stop it first",
              file=sys.stderr)
        return False
    if sys.stdin.isatty():
        answer = input(f"delete {layout.uri} (every step, checkpoint and eval) and start run "
                       f"{s.run_name} over? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("--fresh: nothing deleted", file=sys.stderr)
            return False
    if cluster_address(cfg.cluster, start=False) is not None:
        connect(cfg.cluster)
        kill_run_actors(cfg)
    layout.store.delete()
    print(f"--fresh: deleted {layout.uri}", file=sys.stderr)
    return True


def _runs_root(args: argparse.Namespace) -> Any:
    """The store at `--root`, with the credentials of `--set storage.*` (options or a
    credentials block) or else the shell's `AWS_*`."""
    from flows.config.loader import cli_storage
    from flows.config.storage_credentials import storage_options
    from storage.object_store import open_store

    storage = cli_storage(args.root, args.endpoint_url, args.set)
    with_credentials = storage.model_copy(update={"storage_options": storage_options(storage)})
    return open_store(args.root, args.endpoint_url, **with_credentials.options_for(args.root))


def _no_such_run(args: argparse.Namespace) -> bool:
    """Say so when `--root` has no run `args.run`."""
    if _runs_root(args).child(args.run).exists("config.yaml"):
        return False
    print(f"no run {args.run!r} under {args.root}", file=sys.stderr)
    return True


def cmd_replay(args: argparse.Namespace) -> int:
    from flows.config.loader import cli_storage

    # a mistyped run is named at once: before the replay flow's imports (seconds) and a
    # Prefect server start (unless the root's credentials are in a block, read from it)
    block = cli_storage(args.root, args.endpoint_url, args.set).credentials_block
    if block is None and _no_such_run(args):
        return 1
    from flows.replay import parse_steps, replay, replay_config
    from flows.servers.prefect_server import local_prefect_api

    prefect_env_defaults()
    _user_code_importable()
    steps = parse_steps(args.steps)
    with local_prefect_api():
        if _no_such_run(args):
            return 1
        source = _runs_root(args).child(args.run)
        cfg = replay_config(source.read_text("config.yaml"), args.root, args.run, steps,
                            args.set, args.endpoint_url)
        result = replay(cfg, args.run, *steps)
    _print_result(result, args.result_out)
    return 0


def _print_result(result: dict[str, Any], out: TextIO) -> None:
    """The run's result as JSON, the only thing a flow command writes to stdout (scriptable)."""
    print(json.dumps({k: v for k, v in result.items() if k != "evals"}, indent=1, default=str),
          file=out)


def cmd_server(args: argparse.Namespace) -> int:
    from engines.cluster.head import warn_if_public
    from flows.servers.prefect_server import serve_forever

    warn_if_public("rollflow server --host", args.host)

    return serve_forever(args.host, args.port, args.home, args.result_out, args.database)


def cmd_engine(args: argparse.Namespace) -> int:
    from engines.inference.standalone import serve

    return serve(args)


def cmd_cluster(args: argparse.Namespace) -> int:
    from engines.cluster import head as cluster
    from flows.config.run import ClusterConfig

    cfg, out = ClusterConfig(address=args.address, namespace=args.namespace), args.result_out
    if args.action == "up":
        print(cluster.cluster_address(cfg, start=True), file=out)
    elif args.action == "down":
        return cluster_down(cfg, args.force, out)
    elif args.json:
        print(json.dumps(cluster.status(cfg), indent=1), file=out)
    else:
        print(format_status(cluster.status(cfg)), file=out)
    return 0


def cluster_down(cfg: Any, force: bool, out: Any) -> int:
    """Stop the local head, unless runs have actors on it: every run on this machine shares
    the head, and taking it down ends another shell's (or user's) training."""
    import ray

    from engines.cluster import head as cluster

    runs = [] if force else cluster.runs_with_actors(cfg)
    ray.shutdown()  # (runs_with_actors attached this process)
    if runs:
        print(f"rollflow cluster down: refused, run(s) {', '.join(runs)} have actors on the "
              "local head (a training, or actors kept for the next one): stop each with "
              "`rollflow runs stop RUN`, or stop the head anyway with "
              "`rollflow cluster down --force` (those runs end and resume when rerun)",
              file=sys.stderr)
        return 1
    print("stopped" if cluster.stop_local_head() else "no local cluster recorded", file=out)
    return 0


def format_status(status: dict[str, Any]) -> str:
    """`cluster status` for people: the head, then each run's actors with their age."""
    if status["address"] is None:
        return "no local Ray head running (`rollflow cluster up` starts one)"
    lines = [f"head {status['address']} ({'alive' if status['alive'] else 'not running'})"]
    if status["alive"]:
        res = status.get("resources", {})
        lines.append(f"resources: {res.get('CPU', 0):g} CPU, {res.get('GPU', 0):g} GPU")
        lines.append(_dashboard_line(status.get("dashboard"), status.get("auth")))
    by_run: dict[str, list[dict[str, Any]]] = {}
    for actor in status["actors"]:
        by_run.setdefault(actor.get("run") or "(other)", []).append(actor)
    for run, actors in sorted(by_run.items()):
        lines.append(f"run {run}: {len(actors)} actor(s)")
        lines += [f"  {a.get('role') or a['name']:<16} {a['state']:<8} {a['class']:<22} "
                  f"age {a['age_s']:.0f}s" for a in actors]
    lines += [f"placement group {g['name']}: {g['bundles']} bundle(s), {g['state']}"
              for g in status["placement_groups"]]
    return "\n".join(lines)


def _dashboard_line(url: str | None, auth: str | None) -> str:
    """The dashboard's URL and how to reach Ray's state API (`ray list actors`) through it."""
    if not url:
        return ("dashboard: not running (Ray's state API needs it: a head started where "
                "ray[default] is installed runs one)")
    from engines.process import TOKEN_FILE

    path = os.environ.get("RAY_AUTH_TOKEN_PATH", str(TOKEN_FILE))
    token = f"RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={path} " if auth == "token" else ""
    return f"dashboard {url}  (state API: {token}ray list actors --address {url})"


def cmd_stop_run(args: argparse.Namespace) -> int:
    """`runs stop RUN`: that run's actors and placement group only; other runs go on. The
    run directory's ACTORS_KEPT marker goes too: nothing is left for a rerun to free."""
    from engines.cluster import head as cluster
    from engines.cluster.registry import run_key, stop_run
    from flows.bookkeeping.driver_record import read_record
    from flows.config.run import ClusterConfig
    from storage.run_layout import ACTORS_KEPT, RunLayout

    run_dir = _runs_root(args).child(args.run)
    cfg = ClusterConfig(address=args.address, namespace=args.namespace)
    address = cluster.cluster_address(cfg, start=False)
    stopped = 0
    if address is not None:
        cluster.connect(cfg)
        stopped = stop_run(cfg.namespace, run_key(args.root, args.run))  # RUN under --root
    if not stopped and not run_dir.exists("config.yaml"):
        print(f"no run {args.run!r} under {args.root}", file=sys.stderr)
        return 1
    print(f"run {args.run}: stopped {stopped} actor(s)" if address is not None else
          "no cluster running: no actors to stop", file=args.result_out)
    run_dir.delete(ACTORS_KEPT)  # if there
    driver = read_record(RunLayout(run_dir))
    if driver is not None and driver.running():
        print(f"run {args.run}: its driver (pid {driver.pid}) is still running and starts new "
              f"actors for its next step; to end the run, stop the driver (Ctrl-C, or kill "
              f"{driver.pid})", file=sys.stderr)
    return 0


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


RUN_COLUMNS = ("rollout_id", "reward/mean", "train/loss", "time/generate", "time/train")


def run_columns(config: dict[str, Any] | None) -> tuple[str, ...]:
    """`runs show`'s columns: an SFT run has no reward, its loss is the figure to follow."""
    from flows.bookkeeping.run_status import headline_metric, loss_type_of

    if headline_metric(loss_type_of(config)) == "reward/mean":
        return RUN_COLUMNS
    return tuple(c for c in RUN_COLUMNS if c != "reward/mean")


def _list_runs(root: Any, args: argparse.Namespace) -> None:
    """One line a run: name, status, steps committed (of the configured), then a failed or
    stopped run's cause, else its latest eval."""
    from flows.bookkeeping.run_status import is_run, run_status
    from storage.run_layout import RunLayout

    names = root.list()
    if not names:
        print(f"no runs under {args.root}", file=sys.stderr)
    for name in names:
        layout = RunLayout(root.child(name))
        if not is_run(layout):
            continue
        status = run_status(layout)
        evals = layout.evals()
        last_eval = evals[max(evals)] if evals else {}
        detail = status.cause or " ".join(
            f"{k}={_fmt(v)}" for k, v in last_eval.items() if k.count("/") == 1)
        fields = [name, status.state, f"steps={status.steps()}", detail]
        print("\t".join(f for f in fields if f), file=args.result_out)


def _show_run(root: Any, args: argparse.Namespace) -> int:
    """The run's status, cause and the command that resumes it, then its step metrics."""
    from flows.bookkeeping.run_status import is_run, resume_command, run_status, saved_config
    from storage.run_layout import RunLayout

    layout, out = RunLayout(root.child(args.run)), args.result_out
    if not is_run(layout):
        print(f"no run {args.run!r} under {args.root}", file=sys.stderr)
        return 1
    status = run_status(layout)
    print(f"run {args.run}: {status.state}, {status.steps()} steps committed", file=out)
    if status.cause:
        print(f"cause: {status.cause}", file=out)
    if (command := resume_command(layout, status)) is not None:
        print(f"to resume: {command}", file=out)
    columns = run_columns(saved_config(layout))
    steps = layout.committed_steps()
    if steps:
        print("\t".join(columns), file=out)
    for k in steps:
        m = layout.step_metrics(k)
        print("\t".join(_fmt(m.get(c, "")) for c in columns), file=out)
    for version, ev in sorted(layout.evals().items()):
        print(f"eval@v{version}\t" + " ".join(f"{k}={_fmt(v)}" for k, v in ev.items()),
              file=out)
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    if args.action == "stop":
        return cmd_stop_run(args)
    if args.action == "list":
        _list_runs(_runs_root(args), args)
        return 0
    return _show_run(_runs_root(args), args)


def cmd_engines(args: argparse.Namespace) -> int:
    """`engines add|remove RUN`: ask a running (or stopped) training for more or fewer
    engines. The request is stored in the run directory; the run's next weight push (or the
    driver, when it resumes) grows or shrinks the pool to it (docs/fault-tolerance.md)."""
    import yaml

    from storage.engine_pool import read_pool_request, write_pool_request

    if _no_such_run(args):
        return 1
    run_dir, out = _runs_root(args).child(args.run), args.result_out
    config = yaml.safe_load(run_dir.read_text("config.yaml")) or {}
    engine, rollout = config.get("engine") or {}, config.get("rollout") or {}
    configured = int(engine.get("num_engines", 1))
    if engine.get("urls") or rollout.get("debug_train_only"):
        why = "engine.urls lists its servers" if engine.get("urls") else "it runs no engines"
        print(f"run {args.run}: its engine pool is fixed ({why})", file=sys.stderr)
        return 1
    request = read_pool_request(run_dir)
    now = configured if request is None else request.target(configured)
    if args.action == "show":
        print(f"run {args.run}: engine pool {now} (engine.num_engines={configured})", file=out)
        return 0
    if args.count < 1:
        print(f"--count {args.count}: a count of engines is 1 or more", file=sys.stderr)
        return 1
    wanted = now + args.count if args.action == "add" else now - args.count
    if wanted < 1:
        print(f"run {args.run}: its pool has {now} engine(s); it keeps at least one",
              file=sys.stderr)
        return 1
    write_pool_request(run_dir, wanted, configured)
    print(f"run {args.run}: engine pool {now} -> {wanted} at its next weight push (the end "
          "of the step it is in)", file=out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollflow", description=__doc__)
    parser.add_argument("--verbose", action="store_true",
                        help="on failure, print the full traceback (always kept in a log file)")
    parser.set_defaults(runs_flows=False)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="run (or resume) the train flow", description=(
        "Train the run the config names (storage.uri/storage.run_name). Run the same command "
        "again to resume it: committed steps are kept and the run goes on at the first "
        "uncommitted step; add --fresh to delete the run and start it over. `rollflow runs "
        "show RUN` tells where a run stopped and why."))
    p.add_argument("--config", required=True, help="YAML config file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override, e.g. rollout.num_rollout=4 (repeatable)")
    p.add_argument("--fresh", action="store_true",
                   help="start the run over: delete its directory (asks first on a terminal) "
                        "and its actors")
    p.set_defaults(func=cmd_train, runs_flows=True)

    p = sub.add_parser("replay", help="train again on the saved batches of a run, no engines")
    p.add_argument("run", help="source run under --root")
    p.add_argument("--steps", required=True, help="A:B, the rollout ids A..B-1 to replay")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override of the source run's config (new run: <run>-replay-A-B)")
    p.add_argument("--root", default="./runs", help="storage root of the runs")
    p.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint")
    p.set_defaults(func=cmd_replay, runs_flows=True)

    p = sub.add_parser("server", help="a Prefect server with its UI on 127.0.0.1")
    p.add_argument("--host", default="127.0.0.1",
                   help="address the server and its UI listen on (default 127.0.0.1: this "
                        "machine only)")
    p.add_argument("--port", type=int, default=4200, help="port (default 4200)")
    p.add_argument("--home", default=None, help="PREFECT_HOME of the server (its database)")
    p.add_argument("--database", default=None,
                   help="the server's database, e.g. postgresql://user@127.0.0.1:5432/prefect "
                        "(default: SQLite under its PREFECT_HOME)")
    p.set_defaults(func=cmd_server)

    p = sub.add_parser("engine", help="the embedded engine as a server on its own (SGLang's "
                       "native and OpenAI-compatible API), like sglang.launch_server")
    add_engine_arguments(p)
    p.set_defaults(func=cmd_engine)

    p = sub.add_parser("cluster", help="the persistent local Ray cluster")
    p.add_argument("action", choices=["up", "down", "status"],
                   help="up: start the local head (or name the running one); down: stop it; "
                        "status: the head and each run's actors")
    p.add_argument("--address", default=None,
                   help="Ray address of the cluster (default: the local head rollflow "
                        "started)")
    p.add_argument("--namespace", default="rollflow", help="Ray namespace of the actors")
    p.add_argument("--json", action="store_true", help="status as JSON")
    p.add_argument("--force", action="store_true",
                   help="down: stop the head even while runs have actors on it")
    p.set_defaults(func=cmd_cluster)

    p = sub.add_parser("runs", help="runs in a storage root; `stop RUN` frees its actors")
    common = argparse.ArgumentParser(add_help=False)  # (options before or after RUN)
    common.add_argument("--root", default="./runs",
                        help="storage root of the runs: a directory or s3://bucket/prefix "
                             "(default ./runs)")
    common.add_argument("--endpoint-url", default=None,
                        help="S3-compatible endpoint of --root (default: AWS S3)")
    common.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="storage credentials, e.g. storage.storage_options={key: K, "
                        "secret: S} or storage.credentials_block=NAME (default: AWS_* of the "
                        "shell)")
    common.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS)
    actions = p.add_subparsers(dest="action", required=True, metavar="{list,show,stop}")
    actions.add_parser("list", parents=[common], help="the runs: status (running, failed, "
                       "complete, stopped), steps committed, a failure's cause or the latest "
                       "eval")
    actions.add_parser("show", parents=[common], help="a run's status, cause and resume "
                       "command, then its step metrics and evals"
                       ).add_argument("run", help="run name under --root")
    stop = actions.add_parser("stop", parents=[common], help="free a run's actors")
    stop.add_argument("run", help="run name under --root")
    stop.add_argument("--address", default=None, help="Ray address (default: local head)")
    stop.add_argument("--namespace", default="rollflow", help="Ray namespace of the run")
    p.set_defaults(func=cmd_runs, run=None)

    p = sub.add_parser("engines", help="grow or shrink a training's engine pool; it takes "
                       "effect at the run's next weight push")
    actions = p.add_subparsers(dest="action", required=True, metavar="{add,remove,show}")
    for action, what in (("add", "start N more engines"), ("remove", "drain and stop N"),
                         ("show", "the pool size the run is asked to have")):
        one = actions.add_parser(action, parents=[common], help=what)
        one.add_argument("run", help="run name under --root")
        if action != "show":
            one.add_argument("--count", type=int, default=1, help="N (default 1)")
    p.set_defaults(func=cmd_engines)

    # --verbose after the subcommand too; SUPPRESS keeps one given before it.
    for p in sub.choices.values():
        p.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS,
                       help=argparse.SUPPRESS)
    _describe_by_help(sub)
    return parser


def _describe_by_help(sub: Any) -> None:
    """`rollflow X -h` opens with the line `rollflow -h` lists for X, unless X has its own."""
    for choice in sub._choices_actions:
        one = sub.choices[choice.dest]
        one.description = one.description or choice.help
        for inner in one._subparsers._group_actions if one._subparsers else ():
            _describe_by_help(inner)


def _innermost(parser: argparse.ArgumentParser, args: argparse.Namespace
               ) -> argparse.ArgumentParser:
    """The (sub)command parser `args` came through: its usage is the one to show."""
    for name in ("command", "action"):
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)
                    and a.dest == name), None)
        if sub is None or getattr(args, name, None) not in sub.choices:
            break
        parser = sub.choices[getattr(args, name)]
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """As `parse_args`, but an unknown option is refused with its subcommand's usage
    (`rollflow train --nope` shows `train`'s options, not the top-level ones)."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _innermost(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.func is cmd_train:  # on a terminal: a line as each phase of the start begins
        from flows.bookkeeping.start_lines import phase, tell_start

        tell_start()
        phase(f"reading the config {args.config}")
    if args.runs_flows:
        prefect_env_defaults()  # before quiet_prefect_failures makes Prefect set up its logging
    # A command's stdout holds its own output only (a flow command's: its JSON result), written
    # to args.result_out; whatever else prints while it runs (Ray's "(raylet)" warnings from
    # its log thread, user hooks) goes to stderr.
    args.result_out = sys.stdout
    # Failures print their cause in one line first, the traceback goes to a log file.
    with redirect_stdout(sys.stderr), \
            quiet_prefect_failures() if args.runs_flows else nullcontext() as held:
        try:
            return int(args.func(args))
        except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM once attached to Ray
            from engines.cluster.head import Terminated

            what, code = ("terminated", 143) if isinstance(stop, Terminated) else ("interrupted", 130)
            where = run_dir_of(args)
            print(f"{what}{f' ({where})' if where else ''}: committed steps are kept; run the "
                  "same command again to resume", file=sys.stderr)
            return code
        except BrokenPipeError:  # `rollflow runs show X | head`: the reader has enough
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        except Exception as e:
            return report_failure(e, run_dir=run_dir_of(args), verbose=args.verbose, held=held,
                                  command=argv)

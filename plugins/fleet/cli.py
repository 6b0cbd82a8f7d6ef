"""Serve a checkpoint from several `mqa-serve` replicas behind vLLM's router, from one command.
Run as `mqa-fleet`, `python -m plugins.fleet` or `scripts/fleet.py`.

  mqa-fleet checkpoints/santacoder-1b --replicas 2 --port 8000 --dtype bfloat16 --kv-budget 1GB
  mqa-fleet /tmp/tiny --replicas 1 --workers http://10.0.0.7:8000 --port 8000   # plus a server elsewhere
  mqa-fleet --replicas 0 --workers http://10.0.0.7:8000 http://10.0.0.8:8000    # route only

Starts N replicas on free ports of 127.0.0.1 (each pinned to its share of this machine's cores), waits
until each answers /health, then `vllm-router` on --host:--port over them and the --workers. Clients
talk to the router as to one server (every mqa-serve endpoint: /v1/completions, /v1/chat/completions,
...). Flags this command does not know are mqa-serve's and go to every replica. The default policy,
cache_aware, sends requests that share a prefix to the replica that holds it (its prefix cache then
skips that prefill). Ctrl-C or SIGTERM stops the router, then the replicas (each drains its requests).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from pathlib import Path

from plugins.launch.launcher import free_port
from plugins.fleet.replicas import (ROUTER_POLICIES, Child, Fleet, FleetError, core_shares, healthy, replica_command,
                                    router_command)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="mqa-fleet", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 usage="mqa-fleet [CHECKPOINT] [--replicas N] [--port P] [options] "
                                       "[mqa-serve options]")
    ap.add_argument("checkpoint_dir", type=Path, nargs="?", help="the checkpoint every replica serves")
    ap.add_argument("--replicas", type=int, default=2, help="mqa-serve processes on this machine (default 2)")
    ap.add_argument("--workers", nargs="+", default=[], metavar="URL",
                    help="servers started elsewhere (mqa-serve or any vLLM-compatible one) to route to as well")
    ap.add_argument("--host", default="127.0.0.1", help="the router's address (replicas listen on 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8000, help="the router's port")
    ap.add_argument("--policy", choices=ROUTER_POLICIES, default="cache_aware", help="the router's policy")
    ap.add_argument("--health-check-interval", type=int, default=5,
                    help="seconds between the router's health checks of each worker (default 5)")
    ap.add_argument("--log-dir", type=Path, help="where the replicas' and the router's logs go (default a new "
                                                 "temporary directory)")
    ap.add_argument("--startup-timeout", type=float, default=600.0,
                    help="seconds a replica may take to load and answer /health")
    args, serve_args = ap.parse_known_args(argv)
    if args.replicas < 0:
        ap.error(f"--replicas must be >= 0, got {args.replicas}")
    if args.replicas == 0 and not args.workers:
        ap.error("nothing to route to: give --replicas N (with a checkpoint) or --workers URL ...")
    if args.replicas and args.checkpoint_dir is None:
        ap.error("--replicas needs the CHECKPOINT directory to serve")
    if args.health_check_interval < 1:
        ap.error("--health-check-interval must be >= 1")
    for url in args.workers:
        if not url.startswith(("http://", "https://")):
            ap.error(f"--workers takes URLs such as http://HOST:PORT, got {url!r}")
    if args.replicas:
        from plugins.http.cli import check_args
        from plugins.http.cli import parse_args as serve_parse_args

        for flag in ("--host", "--port"):  # the replicas' own: chosen here
            if any(a == flag or a.startswith(flag + "=") for a in serve_args):
                ap.error(f"{flag} is the router's here; replicas listen on free ports of 127.0.0.1")
        serve_ap, serve = serve_parse_args([str(args.checkpoint_dir), *serve_args])
        if serve.nnodes > 1:
            ap.error("a fleet's replicas run on this machine; spread TP over machines with mqa-serve --nnodes "
                     "and route to it with --workers")
        check_args(serve_ap, serve)  # mqa-serve's own checks and messages, before any replica starts
    elif serve_args:
        ap.error(f"unrecognized arguments: {' '.join(serve_args)} (mqa-serve options need --replicas)")
    return ap, args, serve_args


def main(argv=None) -> int:
    ap, args, serve_args = parse_args(argv)
    down = [url for url in args.workers if not healthy(url.rstrip("/"))]
    if down:
        ap.error(f"--workers {' '.join(down)}: no answer 200 on /health")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="mqa-fleet-"))
    log_dir.mkdir(parents=True, exist_ok=True)


    shares = core_shares(sorted(os.sched_getaffinity(0)), args.replicas)
    replicas = []
    for i in range(args.replicas):
        port = free_port()
        replicas.append(Child(f"replica {i}", replica_command(args.checkpoint_dir, port, serve_args),
                              log_dir / f"replica-{i}.log", url=f"http://127.0.0.1:{port}", cores=shares[i],
                              env={"OMP_NUM_THREADS": str(len(shares[i]))}))
    urls = [c.url for c in replicas] + [u.rstrip("/") for u in args.workers]
    router = Child("the router", router_command(urls, args.host, args.port, args.policy, free_port(),
                                                args.health_check_interval),
                   log_dir / "router.log", url=f"http://{_connectable(args.host)}:{args.port}")
    fleet = Fleet(replicas, args.workers, router, args.startup_timeout)
    print(f"starting {args.replicas} replica(s) of {args.checkpoint_dir} (cores {shares}), logs in {log_dir}",
          flush=True)

    stopping = []

    def stop(signum, frame):
        stopping.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        fleet.start()
        print(f"serving on http://{args.host}:{args.port}/v1 through vllm-router (policy {args.policy}) over "
              f"{', '.join(urls)} (Ctrl-C or SIGTERM stops)", flush=True)
        reason = fleet.wait()
    except FleetError as e:
        print(f"mqa-fleet: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        reason = None
    finally:
        fleet.stop()
    if reason:
        print(f"mqa-fleet: stopping: {reason}", file=sys.stderr, flush=True)
        return 1
    return 0


def _connectable(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


if __name__ == "__main__":
    sys.exit(main())

"""Entry point: ``python -m sluice.bench {prefetch,receive,limiter,tuner,apply,coordination,delivery,listing,cache,mount,dlio,scale,soak,train} ...``."""

from __future__ import annotations

import signal
import sys

_SUBCOMMANDS = {
    "prefetch": "training-loop throughput, cold cache: naive, threadpool, torch, sluice, fio",
    "receive": "micro benchmark of the client's receive path",
    "limiter": "does the stage's rate and ops limiter hold its target (cold, no compute)",
    "tuner": "fixed reader counts vs the auto-tuner from 1 reader, then a compute-bound phase",
    "apply": "time from sluicectl apply until every stage acknowledged the new settings",
    "coordination": "a controller sharing one pool among weighted jobs through four phases, vs stages on their own",
    "delivery": "into the training loop: socket vs shared memory (hot), PyTorch DataLoaders (cold, and decoding)",
    "listing": "a million-entry dataset: listing time and stage memory per entry (dir or s3)",
    "mount": "file-reading PyTorch DataLoaders through the stage's mount vs the plain directory and the socket",
    "dlio": "the DLIO benchmark (unet3d, resnet50 shapes) on the plain directory and through the mount",
    "scale": "the controller under thousands of simulated stages: CPU, RSS, tick, apply to every ack",
    "soak": "an hour of trainers through two stages with random applies and restarts: memory flat, nothing lost",
    "train": "a real training loop (ResNet on the GPU when there is one) fed four ways: AU and samples/s",
    "cache": "the node cache under per-epoch random order: stable subset vs LRU, a cache that fits, two jobs",
}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in _SUBCOMMANDS:
        print("usage: python -m sluice.bench {" + ",".join(_SUBCOMMANDS) + "} [options]\n")
        for name, what in _SUBCOMMANDS.items():
            print(f"  {name:10} {what}")
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nunknown subcommand {argv[0]!r}", file=sys.stderr)
            return 2
        return 0
    if argv[0] == "prefetch":
        from .prefetch import main as run
    elif argv[0] == "limiter":
        from .limiter import main as run
    elif argv[0] == "tuner":
        from .tuner import main as run
    elif argv[0] == "apply":
        from .apply import main as run
    elif argv[0] == "coordination":
        from .coordination import main as run
    elif argv[0] == "delivery":
        from .delivery import main as run
    elif argv[0] == "listing":
        from .listing import main as run
    elif argv[0] == "mount":
        from .mount import main as run
    elif argv[0] == "dlio":
        from .dlio import main as run
    elif argv[0] == "scale":
        from .scale import main as run
    elif argv[0] == "soak":
        from .soak import main as run
    elif argv[0] == "train":
        from .train import main as run
    elif argv[0] == "cache":
        from .cache import main as run
    else:
        from .receive import main as run
    from .dataset import DatasetError
    from .harness import HarnessError
    from .stage import StageStartError

    # SIGTERM (a scheduler, `timeout`, `kill`) unwinds as Ctrl-C does, so
    # the stages, mounts and directories a run started go with it.
    terminated = []

    def terminate(signum, _frame):
        terminated.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        code = run(argv[1:])
        if terminated:
            # The interrupt landed in a finalizer, which Python reports and
            # swallows: the run went on to its end, but it was terminated.
            print("terminated", file=sys.stderr)
            return 128 + terminated[0]
        return code
    except (TimeoutError, StageStartError, HarnessError, DatasetError) as e:
        # A process the benchmark needs did not come up, or its data set
        # cannot be written: its own words, on one line, not a traceback.
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("terminated" if terminated else "interrupted", file=sys.stderr)
        return 128 + (terminated[0] if terminated else signal.SIGINT)
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())

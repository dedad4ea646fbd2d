"""Benchmarks for sluice: ``python -m sluice.bench <subcommand> --help``.

- ``prefetch``: cold-cache training-loop throughput of sluice against the
  usual ways a Python trainer reads files (and fio's device limit);
- ``receive``: micro benchmark of the client's receive path;
- ``limiter``: the stage's byte-rate and ops limits against their targets;
- ``tuner``: fixed reader counts against the auto-tuner starting from one
  reader, then a compute-bound phase where it should let go.
"""

"""Benchmarks for sluice: ``python -m sluice.bench <subcommand> --help``.

- ``prefetch``: cold-cache training-loop throughput of sluice against the
  usual ways a Python trainer reads files (and fio's device limit);
- ``receive``: micro benchmark of the client's receive path.
"""

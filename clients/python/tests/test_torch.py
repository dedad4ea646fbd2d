"""The PyTorch adapters with real DataLoaders against the real stage.

Skipped when torch does not import, except with ``CI=true``, where that is a
failure: a silent skip in CI would hide that nothing was tested.
"""

from __future__ import annotations

import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from conftest import files_of, http_get, in_ci, job_metric, sorted_names, stage_metric, wait_for

try:
    import torch  # noqa: F401
    from torch.utils.data import DataLoader
except ImportError as e:  # pragma: no cover - depends on the machine
    if in_ci():
        raise RuntimeError(f"CI=true but torch does not import ({e}); install clients/python[torch]") from e
    pytest.skip(f"torch does not import ({e})", allow_module_level=True)

import sluice
from sluice import plan as splan
from sluice import protocol as p
from sluice.bench.common import metric_value, parse_prometheus
from sluice.torch import SluiceDataset, SluiceIterableDataset, SluiceSampler, collate

WORLD = 2

# Four workers on a two-core machine is the point of some tests.
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def _bytes(sample) -> bytes:
    """A sample's bytes, whatever it was handed over as."""
    return sample.numpy().tobytes() if isinstance(sample, torch.Tensor) else bytes(sample)


def _collect(loader):
    out = []
    for names, datas in loader:
        out += [(n, _bytes(d)) for n, d in zip(names, datas)]
    return out


#: Ranks of the even-share tests: the tests' data set does not split
#: evenly between them.
EVEN_WORLD = 5


def _distributed_shares(files, even):
    """The epoch's order (seed 7, epoch 2) and, for each rank of
    ``EVEN_WORLD``, ``DistributedSampler``'s share of it as names."""
    from torch.utils.data import DistributedSampler

    assert len(files) % EVEN_WORLD, "the point is a data set that ranks cannot share evenly"
    names = sorted_names(files)
    everything = splan.permutation(len(files), 7, 2)
    return everything, [[names[everything[i]] for i in DistributedSampler(
        everything, num_replicas=EVEN_WORLD, rank=rank, shuffle=False, drop_last=even == "drop")]
        for rank in range(EVEN_WORLD)]


@pytest.mark.parametrize("even", ["pad", "drop"])
def test_even_shares_are_distributed_samplers_shares_of_the_plan_order(stage_factory, dataset, even):
    root, files = dataset
    stage = stage_factory({"d": root})
    names = sorted_names(files)
    world = EVEN_WORLD
    everything, shares = _distributed_shares(files, even)
    counts = {}
    for rank in range(world):
        ds = SluiceDataset(stage.socket, "d", job=f"even-{even}")
        # Odd ranks count epochs with NumPy integers (`for epoch in
        # np.arange(...)`): their arithmetic overflowed in the plan.
        integer = np.int64 if rank % 2 else int
        sampler = SluiceSampler(ds, seed=integer(7), rank=rank, world_size=world, even=even)
        sampler.set_epoch(integer(2))
        expected = shares[rank]
        assert len(sampler) == len(expected) == (len(files) // world + (even == "pad"))
        got = _collect(DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2 if rank == world - 1 else 0,
                                  collate_fn=collate))
        assert [n for n, _ in got] == expected
        assert all(files[n] == d for n, d in got)
        for n, _ in got:
            counts[n] = counts.get(n, 0) + 1
        sampler.close()
        ds.close()
    extra = len(files) % world
    if even == "pad":
        # The epoch's first samples are read again by the ranks short of one.
        again = {names[i] for i in everything[:world - extra]}
        assert counts == {n: 2 if n in again else 1 for n in files}
    else:
        left_out = {names[i] for i in everything[len(files) - extra:]}
        assert counts == {n: 1 for n in files if n not in left_out}
    with pytest.raises(ValueError, match='even must be None, "pad" or "drop"'):
        SluiceSampler(SluiceDataset(stage.socket, "d", job="x"), even="yes")


@pytest.mark.parametrize("even", ["pad", "drop"])
def test_iterable_even_shares_are_distributed_samplers_shares_split_between_workers(stage_factory, dataset,
                                                                                   even):
    root, files = dataset
    stage = stage_factory({"d": root})
    world = EVEN_WORLD
    _everything, shares = _distributed_shares(files, even)
    for rank, workers in ((0, 0), (3, 2), (4, 3)):
        ds = SluiceIterableDataset(stage.socket, "d", job=f"iter-even-{even}", seed=np.uint64(7), rank=rank,
                                   world_size=world, batch=3, even=even, prefetch=np.int64(2))
        ds.set_epoch(np.int32(2))
        expected = shares[rank]
        assert len(ds) == len(expected) == (len(files) // world + (even == "pad"))
        got = _collect(DataLoader(ds, batch_size=4, num_workers=workers, collate_fn=collate))
        assert sorted(n for n, _ in got) == sorted(expected), f"rank {rank}, {workers} workers"
        assert all(files[n] == d for n, d in got)
        if workers == 0:
            assert [n for n, _ in got] == expected
        ds.close()
    with pytest.raises(ValueError, match='even must be None, "pad" or "drop"'):
        SluiceIterableDataset(stage.socket, "d", job="x", even="yes")


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_workers_started_without_fork_read_their_trainers_plan(stage_factory, dataset, context):
    # Under forkserver the workers' parent is the fork server, not the
    # trainer: they must still name the trainer's run, or their reads miss
    # the sampler's plan, and every sample is read twice from storage (once
    # prefetched for the plan, once for the worker) with the plan's bytes
    # held until the job ends.
    from sluice.bench.common import metric_value, parse_prometheus

    root, files = dataset
    stage = stage_factory({"d": root})
    ds = SluiceDataset(stage.socket, "d", job=f"ctx-{context}")
    sampler = SluiceSampler(ds, seed=4)
    got = _collect(DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2, multiprocessing_context=context,
                              collate_fn=collate))
    assert sorted(n for n, _ in got) == sorted(files)
    assert all(files[n] == d for n, d in got)
    reads = metric_value(parse_prometheus(http_get(stage.metrics, "/metrics")),
                         "sluice_stage_storage_reads_total", job=f"ctx-{context}")
    assert reads == len(files)
    sampler.close()
    ds.close()


DDP_TRAINER = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader
    from sluice.torch import SluiceDataset, SluiceSampler, collate

    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=20))
    ds = SluiceDataset(sys.argv[1], "d", job="ddp")
    sampler = SluiceSampler(ds, seed=3, even="pad")   # rank and world size from torch.distributed
    model = DistributedDataParallel(torch.nn.Linear(1, 1))
    steps = 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for names, samples in DataLoader(ds, batch_size=4, sampler=sampler, num_workers=1, collate_fn=collate):
            x = torch.tensor([[float(len(s))] for s in samples])
            model(x).sum().backward()   # an all-reduce every step
            steps += 1
    print(dist.get_rank(), len(sampler), steps, flush=True)
    dist.destroy_process_group()
""")


def test_ranks_of_a_ddp_job_take_the_same_number_of_steps_with_padded_shares(stage_factory, tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    # 9 files, 2 ranks, batches of 4: unpadded shares of 5 and 4 would be
    # 2 and 1 batches, and rank 0's second all-reduce would wait forever.
    for i in range(9):
        (root / f"s{i}").write_bytes(os.urandom(100 + i))
    stage = stage_factory({"d": root})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "ddp.py"
    script.write_text(DDP_TRAINER)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
               PYTHONPATH=os.pathsep.join(sys.path))
    ranks = [subprocess.Popen([sys.executable, str(script), stage.socket], env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [r.communicate(timeout=120) for r in ranks]
    assert [r.returncode for r in ranks] == [0, 0], [err[-2000:] for _, err in outs]
    assert sorted(out.split() for out, _ in outs) == [["0", "5", "4"], ["1", "5", "4"]]


def test_a_sampler_iterated_again_without_set_epoch_says_what_it_does(stage_factory, dataset):
    """A second pass of a sampler over the same epoch yields every index
    (its files read without prefetching); the warning said that the plan
    delivers nothing, and to leave persistent workers off, which is the
    iterable dataset's story."""
    root, files = dataset
    stage = stage_factory({"d": root})
    ds = SluiceDataset(stage.socket, "d", job="again")
    sampler = SluiceSampler(ds, seed=5)
    loader = DataLoader(ds, batch_size=4, sampler=sampler, collate_fn=collate)
    first = _collect(loader)
    with pytest.warns(sluice.AlreadyReadWarning, match="yields its indices all the same") as caught:
        second = _collect(loader)
    assert not [w for w in caught if "delivers nothing" in str(w.message)], [str(w.message) for w in caught]
    assert sorted(n for n, _ in first) == sorted(n for n, _ in second) == sorted(files)
    sampler.close()
    ds.close()


@pytest.mark.parametrize("workers", [0, 4])
def test_map_style_with_sampler(stage_factory, dataset, workers):
    root, files = dataset
    stage = stage_factory({"d": root})
    names = sorted_names(files)
    seen = []
    for rank in range(WORLD):
        ds = SluiceDataset(stage.socket, "d", job=f"map{workers}")
        assert len(ds) == len(files)
        sampler = SluiceSampler(ds, seed=5, rank=rank, world_size=WORLD)
        assert len(sampler) == len(splan.shuffle_plan(len(files), 5, 3, True, rank, WORLD))
        sampler.set_epoch(3)
        loader = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=workers, collate_fn=collate)
        got = _collect(loader)
        # Order follows the plan (the DataLoader keeps sampler order).
        expected = [names[i] for i in splan.shuffle_plan(len(files), 5, 3, True, rank, WORLD)]
        assert [n for n, _ in got] == expected
        assert sampler.plan_state == p.PlanState.CREATED
        # The workers' whole-file reads delivered every entry of the
        # sampler's plan, so the stage counts it as complete (for the
        # sampler's run: another run would read the epoch in full).
        with sluice.Client(stage.socket, job=f"map{workers}", rank=rank, world_size=WORLD,
                           run=sampler._conn.run) as c:
            assert c.dataset("d").epoch(3, seed=5).state == p.PlanState.COMPLETE
        sampler.close()
        ds.close()
        seen += got
    assert sorted(n for n, _ in seen) == sorted(files)
    assert all(files[n] == d for n, d in seen)
    # The samples came in shared memory.
    assert job_metric(stage, "sluice_stage_shared_samples_total", f"map{workers}") > 0


def _one(sample):
    """A sample, unbatched, as bytes."""
    name, data = sample
    return name, _bytes(data)


def test_a_loader_without_batching_reads_each_sample_from_storage_once(stage_factory, dataset):
    """A DataLoader with workers and batch_size=None makes two iterators of
    its sampler an epoch and throws the first away unread: that one plans
    nothing (its plan had the stage prefetch the epoch, and then again for
    the plan that replaced it)."""
    root, files = dataset
    stage = stage_factory({"d": root})
    ds = SluiceDataset(stage.socket, "d", job="unbatched")
    sampler = SluiceSampler(ds, seed=2)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        loader = DataLoader(ds, sampler=sampler, batch_size=None, num_workers=2, collate_fn=_one)
        got = list(loader)
        assert sorted(n for n, _ in got) == sorted(files) and all(files[n] == d for n, d in got)
    samples = parse_prometheus(http_get(stage.metrics, "/metrics"))
    assert metric_value(samples, "sluice_stage_storage_reads_total", job="unbatched") == 2 * len(files)
    sampler.close()
    ds.close()


def test_loaders_dropped_mid_epoch_give_their_connections_back_without_the_cycle_collector(
        stage_factory, dataset):
    """A notebook cell that builds a dataset, a sampler and a loader, looks
    at a few batches and is run again drops the old objects: their
    connections, and the plans and buffers they hold on the stage, go at
    once (they lasted until Python's cycle collector ran)."""
    import gc

    root, files = dataset
    stage = stage_factory({"d": root})

    def cell(i):
        ds = SluiceDataset(stage.socket, "d", job="cell")
        sampler = SluiceSampler(ds, seed=i)
        it = SluiceIterableDataset(stage.socket, "d", job="cell-it", seed=i)
        for loader in (DataLoader(ds, batch_size=4, sampler=sampler, collate_fn=collate),
                       DataLoader(it, batch_size=4, collate_fn=collate)):
            for n, _ in zip(range(2), loader):
                pass

    gc.disable()
    try:
        for i in range(3):
            cell(i)
        wait_for(lambda: stage_metric(stage, "sluice_stage_connections") == 0, timeout=5,
                 what="the dropped objects' connections to close")
    finally:
        gc.enable()


def test_a_loader_iterated_again_while_an_interrupted_iteration_lives_reads_the_epoch_in_full(
        stage_factory, tmp_path):
    """A notebook cell interrupted mid-epoch keeps its traceback, and with
    it the DataLoader iterator and its workers; the cell run again
    iterates the loader anew. The new workers joined the old ones' plans
    and got what those had left, less the samples they held (1,136 of
    2,000). Each iteration of the loader is now a reading of its own: the
    epoch in full, each sample once, as a plain DataLoader gives it; and
    the loader iterated once more reads it in full again."""
    root = tmp_path / "ds"
    root.mkdir()
    files = {f"{i:04d}.bin": os.urandom(1000) for i in range(400)}
    for name, data in files.items():
        (root / name).write_bytes(data)
    stage = stage_factory({"ds": root})
    ds = SluiceIterableDataset(stage.socket, "ds", job="cell-again", seed=1, batch=8)

    def loader():
        # A cell that seeds torch (or the loader's generator) gives each of
        # its iterations the same base seed.
        return DataLoader(ds, batch_size=8, num_workers=2, collate_fn=collate,
                          generator=torch.Generator().manual_seed(0))
    interrupted = iter(loader())
    first = []
    for names, _ in interrupted:
        first += names
        if len(first) >= 80:
            break
    # `interrupted` lives on, as a kept traceback keeps it: its workers hold
    # their plans and the batches they fetched ahead.
    for _ in range(2):
        again = _collect(loader())
        assert sorted(n for n, _ in again) == sorted(files)
        assert all(files[n] == d for n, d in again)
    del interrupted
    ds.close()


def test_a_trainer_exiting_mid_epoch_exits_cleanly(stage_factory, dataset):
    """A script that ends while an iterable dataset is mid-epoch in its main
    process (its prefetch thread inside a read) exits 0: dropping the
    dataset at interpreter exit does not close the socket's file under the
    frozen thread (CPython aborted on its lock)."""
    root, files = dataset
    stage = stage_factory({"d": root})
    script = textwrap.dedent(f"""
        from torch.utils.data import DataLoader
        from sluice.torch import SluiceIterableDataset
        ds = SluiceIterableDataset({stage.socket!r}, "d", job="exiting", batch=4)
        it = iter(DataLoader(ds, batch_size=None, num_workers=0))
        next(it)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for _ in range(8):
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=120)
        assert done.returncode == 0 and b"Fatal Python error" not in done.stderr, done.stderr[-2000:]


def test_workers_reading_samples_larger_than_the_budget_do_not_wait_on_each_other(stage_factory, tmp_path):
    """Map-style workers (4) reading a sampler's epoch of 24 MiB samples
    on a 16 MiB budget: a worker's read of an entry the stage had already
    read ahead waited for room for answers by name, which the read holding
    that room could not get while the entry sat in the buffer; each such
    read waited 2 s (an epoch of 5 files took 3-7 s, 1.1 s before reads
    by name were bounded). No batch waits that long now."""
    import time

    root = tmp_path / "data"
    files = files_of(root, 5, 24 << 20)
    stage = stage_factory({"d": root}, "--memory-budget", "16MiB")
    ds = SluiceDataset(stage.socket, "d", job="large", sample="bytes")
    sampler = SluiceSampler(ds, seed=1)
    loader = DataLoader(ds, batch_size=1, sampler=sampler, num_workers=4, collate_fn=collate)
    waits = []
    try:
        for epoch in range(3):
            sampler.set_epoch(epoch)
            got, last = {}, time.monotonic()
            for names, datas in loader:
                now = time.monotonic()
                waits.append(now - last)
                last = now
                got.update((n, _bytes(d)) for n, d in zip(names, datas))
            assert got == files, f"epoch {epoch}"
    finally:
        sampler.close()
        ds.close()
    # A read held back is released after 2 s; 24 MiB takes 0.1-0.4 s.
    assert max(waits) < 1.8, f"a batch waited {max(waits):.1f} s ({sorted(waits)})"


def _changing_data_set(tmp_path, count: int, size: int) -> tuple:
    """A data set of ``count`` files of about ``size`` bytes, to change
    between epochs: ``(root, files)``."""
    root = tmp_path / "data"
    root.mkdir()
    files = {f"f{i:02d}": os.urandom(size + i) for i in range(count)}
    for name, data in files.items():
        (root / name).write_bytes(data)
    return root, files


@pytest.mark.parametrize("workers", [0, 2])
def test_files_changed_between_epochs_keep_a_map_style_loader_going(stage_factory, tmp_path, workers):
    """Between epochs a sample is rewritten with another size and another
    renamed (the listing's length unchanged): the next epoch reads the new
    listing, as the stage plans over it (workers started for it, or a
    loader without workers, whose handle opens the data set again), and
    delivers every file once with its current bytes. A file added changes
    what the sampler's indices range over: that is refused, saying so."""
    import time
    root, files = _changing_data_set(tmp_path, 20, 5000)
    stage = stage_factory({"d": root})
    ds = SluiceDataset(stage.socket, "d", job="changing")
    sampler = SluiceSampler(ds, seed=3)

    def epoch(n):
        sampler.set_epoch(n)
        return _collect(DataLoader(ds, batch_size=4, sampler=sampler, num_workers=workers, collate_fn=collate))

    assert dict(epoch(0)) == files
    files["f03"] = os.urandom(7777)
    (root / "f03").write_bytes(files["f03"])
    os.rename(root / "f07", root / "g07")
    files["g07"] = files.pop("f07")
    time.sleep(5.5)  # the stage lists the data set again after 5 s
    got = epoch(1)
    assert sorted(n for n, _ in got) == sorted(files) and dict(got) == files
    (root / "h00").write_bytes(b"new")
    time.sleep(5.5)
    with pytest.raises(sluice.BadPlanError, match="has 21 files now, 20 when"):
        epoch(2)
    sampler.close()
    ds.close()


def test_files_renamed_between_epochs_are_read_by_workers_kept_across_epochs(stage_factory, tmp_path):
    """Workers kept from an earlier epoch (``persistent_workers``) hold its
    listing; after a file is renamed (the count unchanged) the stage tells
    them the sampler planned over a newer one, and they read by that:
    every file once, none by its old name."""
    import time
    root, files = _changing_data_set(tmp_path, 24, 2000)
    stage = stage_factory({"d": root})
    ds = SluiceDataset(stage.socket, "d", job="persistent")
    sampler = SluiceSampler(ds, seed=5)
    loader = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2, persistent_workers=True,
                        collate_fn=collate)

    def epoch(n):
        sampler.set_epoch(n)
        return _collect(loader)

    assert dict(epoch(0)) == files
    os.rename(root / "f03", root / "g03")
    files["g03"] = files.pop("f03")
    time.sleep(5.5)
    got = epoch(1)
    assert sorted(n for n, _ in got) == sorted(files) and dict(got) == files
    del loader
    sampler.close()
    ds.close()


def test_files_changed_between_epochs_keep_an_iterable_loader_without_workers_going(stage_factory, tmp_path):
    """A loader without workers iterates the dataset in the trainer
    process, on one connection: each epoch still reads the stage's listing
    as it is then, and a listing of another length is refused."""
    import time
    root, files = _changing_data_set(tmp_path, 12, 3000)
    stage = stage_factory({"d": root})
    it = SluiceIterableDataset(stage.socket, "d", job="changing-iterable", seed=1)

    def epoch(n):
        it.set_epoch(n)
        return _collect(DataLoader(it, batch_size=4, num_workers=0, collate_fn=collate))

    assert dict(epoch(0)) == files
    os.rename(root / "f05", root / "g05")
    files["g05"] = files.pop("f05")
    time.sleep(5.5)
    got = epoch(1)
    assert sorted(n for n, _ in got) == sorted(files) and dict(got) == files
    (root / "h00").write_bytes(b"new")
    time.sleep(5.5)
    with pytest.raises(sluice.BadPlanError, match="has 13 files now, 12 when"):
        epoch(2)
    it.close()


@pytest.mark.parametrize("workers,kept,context", [(0, False, None), (4, False, None), (2, True, "fork"),
                                                   (2, True, "spawn")])
def test_iterable_shares_one_plan_across_workers(stage_factory, dataset, workers, kept, context):
    """Every rank's share of each epoch, exactly once across the workers.
    Workers kept across epochs (``persistent_workers``) keep the copy of
    the dataset they started with: set_epoch never reached them, so every
    epoch after the first planned the first again, already read in full,
    and yielded nothing (one warning, then silently). The epoch is shared
    with them now, and with workers an epoch iterated again is read again,
    as a plain DataLoader reads it."""
    root, files = dataset
    stage = stage_factory({"d": root})
    job = f"iter{workers}-{context}"
    seen = []
    for rank in range(WORLD):
        ds = SluiceIterableDataset(stage.socket, "d", job=job, seed=8, rank=rank, world_size=WORLD, batch=3)
        assert len(ds) == len(splan.shuffle_plan(len(files), 8, 0, True, rank, WORLD))
        loader = DataLoader(ds, batch_size=4, num_workers=workers, collate_fn=collate, persistent_workers=kept,
                            multiprocessing_context=context)
        for epoch in (0, 1, 2, 2) if workers else (0, 1):
            ds.set_epoch(epoch)
            got = _collect(loader)
            share = {sorted_names(files)[i] for i in splan.shuffle_plan(len(files), 8, epoch, True, rank, WORLD)}
            assert sorted(n for n, _ in got) == sorted(share), f"rank {rank} epoch {epoch}"
            assert all(files[n] == d for n, d in got)
            if epoch == 0:
                seen += got
        del loader
        ds.close()
    assert sorted(n for n, _ in seen) == sorted(files)
    assert job_metric(stage, "sluice_stage_shared_samples_total", job) > 0


RECORD = 4096


@pytest.fixture
def records(tmp_path):
    """Fixed-size records (the default collate stacks them): ``(root, {name: bytes})``."""
    root = tmp_path / "records"
    root.mkdir()
    files = {f"r{i:03d}.bin": os.urandom(RECORD) for i in range(96)}
    for name, data in files.items():
        (root / name).write_bytes(data)
    return root, files


@pytest.mark.parametrize("collate_fn", [None, collate], ids=["default-collate", "sluice-collate"])
@pytest.mark.parametrize("workers", [0, 4])
def test_batches_of_records_reach_the_main_process_whole(stage_factory, records, collate_fn, workers):
    root, files = records
    stage = stage_factory({"d": root})
    ds = SluiceDataset(stage.socket, "d", job="records")
    sampler = SluiceSampler(ds, seed=2)
    loader = DataLoader(ds, batch_size=8, sampler=sampler, num_workers=workers,
                        persistent_workers=workers > 0, collate_fn=collate_fn)
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        seen = {}
        for names, batch in loader:
            assert isinstance(batch, torch.Tensor) and batch.dtype == torch.uint8
            assert tuple(batch.shape) == (len(names), RECORD)
            for name, row in zip(names, batch):
                assert name not in seen
                seen[name] = row.numpy().tobytes()
        assert seen == files, f"epoch {epoch}"
    del loader
    sampler.close()
    ds.close()
    assert job_metric(stage, "sluice_stage_shared_samples_total", "records") >= 2 * len(files)
    # Every slot the workers handed to the main process came back.
    wait_for(lambda: job_metric(stage, "sluice_stage_shared_lent_bytes", "records") == 0,
             what="the handed-over slots to come back")


@pytest.mark.parametrize("loader", ["map", "iterable"])
def test_a_transform_that_changes_a_sample_in_place_is_what_arrives(stage_factory, dataset, loader):
    """A sample a worker changed in place is not handed over by slot (the
    main process would map the stage's bytes, not the change)."""
    root, files = dataset
    stage = stage_factory({"ds": root})

    def flip(sample):
        sample.bitwise_xor_(0xFF)
        return sample

    if loader == "map":
        ds = SluiceDataset(stage.socket, "ds", job=f"inplace-{loader}", transform=flip)
        dl = DataLoader(ds, batch_size=4, sampler=SluiceSampler(ds, seed=1), num_workers=2,
                        collate_fn=collate)
    else:
        ds = SluiceIterableDataset(stage.socket, "ds", job=f"inplace-{loader}", seed=1, batch=4,
                                   transform=flip)
        dl = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=collate)
    got = {}
    for names, samples in dl:
        for name, sample in zip(names, samples):
            got[name] = sample.numpy().tobytes()
    assert got == {name: bytes(b ^ 0xFF for b in data) for name, data in files.items()}


def test_transform_and_repeat_guard(stage_factory, dataset):
    root, files = dataset
    stage = stage_factory({"d": root})
    ds = SluiceIterableDataset(stage.socket, "d", job="xf", transform=len)
    got = dict(iter(ds))
    assert got == {n: len(d) for n, d in files.items()}
    with pytest.raises(RuntimeError, match="set_epoch"):
        list(iter(ds))
    ds.set_epoch(1)
    assert len(list(iter(ds))) == len(files)
    m = SluiceDataset(stage.socket, "d", job="xf-map", transform=lambda t: _bytes(t[:2]))
    name = sorted_names(files)[4]
    assert m[4] == (name, files[name][:2]) and m.name(4) == name
    # The sample types on offer.
    as_bytes = SluiceDataset(stage.socket, "d", job="xf-bytes", sample="bytes")
    assert as_bytes[4] == (name, files[name])
    assert type(as_bytes[4][1]) is bytes
    with pytest.raises(ValueError, match="sample must be"):
        SluiceDataset(stage.socket, "d", job="xf-bad", sample="array")


def test_datasets_pickle_without_their_connection(stage_factory, dataset):
    root, files = dataset
    stage = stage_factory({"d": root})
    ds = SluiceDataset(stage.socket, "d", job="pickle")
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._conn._client is None
    name = sorted_names(files)[0]
    assert _bytes(clone[0][1]) == files[name] and clone[0][0] == name
    it = SluiceIterableDataset(stage.socket, "d", job="pickle2")
    assert pickle.loads(pickle.dumps(it))._conn._client is None
    # A sampler mid-epoch (a checkpoint of the training state) copies its
    # settings and epoch, not its plan, and plans again when iterated.
    sampler = SluiceSampler(ds, seed=4)
    sampler.set_epoch(3)
    first = list(sampler)
    copy = pickle.loads(pickle.dumps(sampler))
    assert copy._plan is None and copy.epoch == 3 and copy.seed == 4
    copy.set_epoch(5)
    assert sorted(copy) == sorted(first)


def test_forked_child_opens_its_own_connection(stage_factory, dataset):
    root, files = dataset
    stage = stage_factory({"d": root})
    ds = SluiceDataset(stage.socket, "d", job="fork")
    parent_client = ds._conn._client
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        try:
            ok = _bytes(ds[1][1]) == files[sorted_names(files)[1]] and ds._conn._client is not parent_client
            os.write(w, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"1"
    os.waitpid(pid, 0)
    # The parent's connection is untouched by the child.
    assert _bytes(ds[2][1]) == files[sorted_names(files)[2]] and ds._conn._client is parent_client


STALLED_TRAINER = textwrap.dedent("""
    import os, sys, time
    from torch.utils.data import DataLoader
    from sluice.torch import SluiceDataset, SluiceSampler, collate
    ds = SluiceDataset(sys.argv[1], "d", job="stalled", sample="bytes")
    loader = DataLoader(ds, batch_size=20, sampler=SluiceSampler(ds, seed=1), num_workers=2,
                        collate_fn=collate)
    it = iter(loader)
    next(it)
    print(" ".join(str(w.pid) for w in it._workers), flush=True)
    time.sleep(600)   # a trainer stuck in its step: the workers' batches pile up
""")


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


def _start_trainer(stage_factory, tmp_path, source: str, files: int):
    """A stage serving ``files`` files of 4 KiB as data set ``d``, and a
    trainer process running ``source`` against it (its first argument is
    the stage's socket); returns both."""
    root = tmp_path / "data"
    root.mkdir()
    for i in range(files):
        (root / f"s{i:04d}").write_bytes(os.urandom(4096))
    stage = stage_factory({"d": root})
    script = tmp_path / "trainer.py"
    script.write_text(source)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    trainer = subprocess.Popen([sys.executable, str(script), stage.socket], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return stage, trainer


def test_workers_end_with_their_killed_trainer_even_with_their_result_pipe_full(stage_factory, tmp_path):
    """Batches of 80 KB fill the pipe to a trainer that stopped taking
    them; killed then, its workers used to block on exit for as long as a
    sibling held the pipe open (minutes), holding their stage connections,
    plans and samples."""
    stage, trainer = _start_trainer(stage_factory, tmp_path, STALLED_TRAINER, files=400)
    try:
        workers = [int(w) for w in trainer.stdout.readline().split()]
        assert len(workers) == 2, trainer.stderr.read()
        def delivered() -> float:
            body = http_get(stage.metrics, "/metrics")
            return sum(float(v) for v in re.findall(
                r'^sluice_stage_delivered_samples_total\{[^}]*job="stalled"[^}]*\} (\S+)$', body, re.M))

        # Two workers, two batches ahead each: 100 samples, more than the
        # pipe to the trainer holds.
        wait_for(lambda: delivered() >= 100, what="the workers' batches waiting for the trainer")
    finally:
        trainer.kill()
        trainer.wait()
    wait_for(lambda: not any(map(_running, workers)), timeout=15,
             what="the workers of a killed trainer to end")
    wait_for(lambda: job_metric(stage, "sluice_stage_trainer_connections", "stalled") == 0, timeout=15,
             what="their connections to close")


STARTING_TRAINER = textwrap.dedent("""
    import os, sys, time
    from torch.utils.data import DataLoader
    from sluice.torch import SluiceDataset, SluiceSampler, collate
    def slow_start(_):
        time.sleep(3)   # a worker_init_fn that takes a while (a tokenizer loads)
    ds = SluiceDataset(sys.argv[1], "d", job="starting", sample="bytes")
    loader = DataLoader(ds, batch_size=8, sampler=SluiceSampler(ds, seed=1), num_workers=2,
                        collate_fn=collate, worker_init_fn=slow_start)
    it = iter(loader)
    print(" ".join(str(w.pid) for w in it._workers), flush=True)
    next(it)
""")


def test_workers_of_a_trainer_killed_while_they_start_end(stage_factory, tmp_path):
    """A trainer killed while its workers are still in `worker_init_fn`:
    by the time they looked, their parent was init, which they took for
    their trainer and watched for good, holding its connection (the stage
    kept the job live for 27 minutes in a churn)."""
    stage, trainer = _start_trainer(stage_factory, tmp_path, STARTING_TRAINER, files=100)
    try:
        workers = [int(w) for w in trainer.stdout.readline().split()]
        assert len(workers) == 2, trainer.stderr.read()
        time.sleep(1)
    finally:
        trainer.kill()
        trainer.wait()
    try:
        wait_for(lambda: not any(map(_running, workers)), timeout=15,
                 what="the workers of a trainer killed while they started to end")
        wait_for(lambda: job_metric(stage, "sluice_stage_job_connections", "starting") == 0, timeout=15,
                 what="the trainer's connection to close")
    finally:
        for pid in filter(_running, workers):
            os.kill(pid, signal.SIGKILL)


def test_two_loops_over_one_dataset_at_once_are_told_what_to_do(stage_factory, dataset):
    """Two iterators of one iterable loader without workers, or a training
    and an evaluation sampler over one SluiceDataset, cannot each have the
    epoch: the errors said to use one Client per iterator, or another epoch
    number, which a user of these classes cannot do as said."""
    root, files = dataset
    stage = stage_factory({"d": root})
    ds = SluiceIterableDataset(stage.socket, "d", job="twice", seed=1, batch=2)
    loader = DataLoader(ds, batch_size=2, collate_fn=collate)
    first = iter(loader)
    next(first)
    second = iter(loader)
    next(second)
    with pytest.raises(sluice.SupersededError, match="iterate one at a time, or give the other loop"):
        list(first)
    ds.close()
    mapped = SluiceDataset(stage.socket, "d", job="train-and-eval")
    train, evaluation = SluiceSampler(mapped, seed=1), SluiceSampler(mapped, shuffle=False)
    # A sampler plans at its first index (a DataLoader asks for it at once).
    training = iter(train)
    next(training)
    with pytest.raises(sluice.PlanConflictError, match="give the other loader a SluiceDataset of its own"):
        next(iter(evaluation))
    # Its own dataset object plans apart.
    apart = SluiceDataset(stage.socket, "d", job="train-and-eval")
    assert sorted(SluiceSampler(apart, shuffle=False)) == list(range(len(files)))


def test_bad_places_seeds_and_epochs_are_named_before_anything_is_planned():
    """A rank, world size, seed or epoch that is no integer (or out of
    range) is a ValueError naming it; NumPy integers are integers. It was a
    TypeError or torch's "manual_seed expected a long" at the first epoch,
    and world_size=0 was blamed on the rank."""
    from sluice.torch import MountSampler

    paths = ["/mnt/sluice/@j/ds/a.bin", "/mnt/sluice/@j/ds/b.bin"]
    socket_path = "/nonexistent/stage.sock"  # nothing connects before an epoch
    with pytest.raises(ValueError, match="world_size must be at least 1, got 0"):
        MountSampler(paths, socket_path, rank=0, world_size=0)
    with pytest.raises(ValueError, match="rank must be an integer, got '1'"):
        MountSampler(paths, socket_path, rank="1", world_size=2)
    with pytest.raises(ValueError, match="seed must be an integer"):
        MountSampler(paths, socket_path, seed="7", rank=0, world_size=1)
    sampler = MountSampler(paths, socket_path, seed=np.int64(7), rank=np.int64(1), world_size=np.int32(2))
    for bad in ("2", 1.5, -1, True):
        with pytest.raises(ValueError, match="epoch must be an integer"):
            sampler.set_epoch(bad)
    sampler.set_epoch(np.int64(3))
    assert len(sampler.order()) == 1

"""The SHUFFLE plan derivation (docs/protocol.md, "Deriving a plan")."""

import time

import pytest

from sluice import plan


def test_known_permutation():
    # The same vectors as data-plane/src/plan.rs tests::known_permutation.
    assert plan.permutation(10, 42, 0, True) == [0, 9, 5, 8, 6, 4, 7, 2, 1, 3]
    assert plan.permutation(10, 42, 1, True) == [2, 3, 9, 7, 5, 8, 6, 4, 0, 1]
    assert plan.permutation(4, 42, 0, False) == [0, 1, 2, 3]
    assert plan.permutation(0, 1, 1, True) == []
    assert plan.permutation(1, 1, 1, True) == [0]


def test_inlined_loop_matches_the_reference_generator():
    for n, seed, epoch in [(2, 0, 0), (17, 3, 5), (1000, 2**64 - 1, 2**63), (333, 7, 0)]:
        rng = plan.SplitMix64(seed, epoch)
        order = list(range(n))
        for i in range(n - 1, 0, -1):
            j = rng.below(i + 1)
            order[i], order[j] = order[j], order[i]
        assert plan.permutation(n, seed, epoch) == order


def test_splitmix64_reference_values():
    # SplitMix64 seeded with 0 (Vigna's reference implementation).
    rng = plan.SplitMix64(0)
    assert [rng.next() for _ in range(3)] == [
        0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_below_rejects_the_biased_tail():
    class Fixed(plan.SplitMix64):
        def __init__(self, values):
            self.values = list(values)

        def next(self):
            return self.values.pop(0)

    m = 3
    limit = m * (2**64 // m)
    assert Fixed([limit, limit + 1, 5]).below(m) == 2  # the first two are rejected
    assert Fixed([limit - 1]).below(m) == (limit - 1) % m


def test_epochs_and_seeds_differ_and_are_permutations():
    a, b, c = plan.permutation(1000, 7, 0), plan.permutation(1000, 7, 1), plan.permutation(1000, 8, 0)
    assert a != b and a != c
    for order in (a, b, c):
        assert sorted(order) == list(range(1000))


@pytest.mark.parametrize("n", [0, 1, 2, 9, 10, 11, 1001])
@pytest.mark.parametrize("w", [1, 2, 3, 4, 7, 16])
def test_sharding_covers_every_file_once(n, w):
    shares = [plan.shuffle_plan(n, 5, 2, True, r, w) for r in range(w)]
    union = [i for s in shares for i in s]
    assert sorted(union) == list(range(n))
    lengths = [len(s) for s in shares]
    assert max(lengths) - min(lengths) <= 1
    order = plan.permutation(n, 5, 2)
    assert shares[0] == order[0::w]


def test_bad_arguments():
    with pytest.raises(ValueError, match="rank"):
        plan.shuffle_plan(10, 0, 0, True, 2, 2)
    with pytest.raises(ValueError, match="world_size"):
        plan.shuffle_plan(10, 0, 0, True, 0, 0)
    with pytest.raises(ValueError, match="seed"):
        plan.permutation(10, -1, 0)
    with pytest.raises(ValueError, match="epoch"):
        plan.permutation(10, 0, 2**64)


def test_twenty_thousand_files_is_fast():
    t = time.perf_counter()
    plan.permutation(20_000, 123, 4)
    assert time.perf_counter() - t < 0.5  # typically ~10 ms; generous for a busy machine

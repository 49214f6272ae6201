"""The assignment solver is exact: checked against brute force on seeded random matrices."""

import itertools
import random

from gpuaas_agent.discovery.assignment import max_weight_assignment


def _brute_force_best(weights):
    rows, cols = len(weights), len(weights[0])
    best = (0, 0)
    for k in range(min(rows, cols), 0, -1):
        for rs in itertools.combinations(range(rows), k):
            for cs in itertools.permutations(range(cols), k):
                if all(weights[r][c] is not None for r, c in zip(rs, cs)):
                    best = max(best, (k, sum(weights[r][c] for r, c in zip(rs, cs))))
    return best


def test_matches_brute_force_on_random_matrices():
    rng = random.Random(20261122)
    for _ in range(200):
        rows, cols = rng.randint(1, 5), rng.randint(1, 5)
        # Large base weight: maximum total then also means maximum cardinality.
        weights = [[None if rng.random() < 0.3 else 1000 + rng.randint(0, 50) for _ in range(cols)] for _ in range(rows)]
        result = max_weight_assignment(weights)
        assert len(set(result.values())) == len(result), "a column was used twice"
        assert all(weights[r][c] is not None for r, c in result.items()), "a forbidden pair was used"
        assert (len(result), sum(weights[r][c] for r, c in result.items())) == _brute_force_best(weights)


def test_greedy_trap_is_solved_optimally():
    # Row 0 likes column 0 best, but only row 1 can use column 0 at all.
    weights = [[10, 9], [8, None]]
    assert max_weight_assignment(weights) == {0: 1, 1: 0}


def test_empty_inputs():
    assert max_weight_assignment([]) == {}
    assert max_weight_assignment([[], []]) == {}

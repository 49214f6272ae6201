"""Maximum-weight bipartite assignment (Hungarian method), pure and deterministic.

Slot planning pairs GPUs with disks and VFs; a greedy pass can strand a GPU
whose only close disk was taken by a GPU that had other choices, so we solve
the assignment exactly. Sizes are tiny (8 GPUs, tens of disks or VFs).
"""

from __future__ import annotations

from collections.abc import Sequence

INF = float("inf")


def max_weight_assignment(weights: Sequence[Sequence[float | None]]) -> dict[int, int]:
    """Row -> column maximising the total weight; ``None`` marks a forbidden pair.

    Every allowed weight should be positive: the solver then also maximises
    how many rows get a column. Ties go to the lower row/column index because
    the search visits them in order.
    """
    rows = len(weights)
    cols = len(weights[0]) if rows else 0
    if rows == 0 or cols == 0:
        return {}
    transposed = rows > cols
    if transposed:
        weights = [[weights[r][c] for r in range(rows)] for c in range(cols)]
        rows, cols = cols, rows
    top = max((w for row in weights for w in row if w is not None), default=0.0)
    # Forbidden pairs cost more than any real one; they are dropped afterwards.
    forbidden = top * (rows + 1) + 1
    cost = [[(top - w) if w is not None else forbidden for w in row] for row in weights]

    # Jonker-Volgenant style shortest augmenting paths with potentials (1-indexed).
    u = [0.0] * (rows + 1)
    v = [0.0] * (cols + 1)
    match_col = [0] * (cols + 1)  # column -> row
    way = [0] * (cols + 1)
    for r in range(1, rows + 1):
        match_col[0] = r
        c0 = 0
        minv = [INF] * (cols + 1)
        used = [False] * (cols + 1)
        while True:
            used[c0] = True
            r0 = match_col[c0]
            delta = INF
            c1 = 0
            for c in range(1, cols + 1):
                if used[c]:
                    continue
                cur = cost[r0 - 1][c - 1] - u[r0] - v[c]
                if cur < minv[c]:
                    minv[c] = cur
                    way[c] = c0
                if minv[c] < delta:
                    delta = minv[c]
                    c1 = c
            for c in range(cols + 1):
                if used[c]:
                    u[match_col[c]] += delta
                    v[c] -= delta
                else:
                    minv[c] -= delta
            c0 = c1
            if match_col[c0] == 0:
                break
        while c0:
            c1 = way[c0]
            match_col[c0] = match_col[c1]
            c0 = c1
    result: dict[int, int] = {}
    for c in range(1, cols + 1):
        r = match_col[c]
        if r == 0:
            continue
        row, col = (c - 1, r - 1) if transposed else (r - 1, c - 1)
        if weights_ok(weights, r - 1, c - 1):
            result[row] = col
    return dict(sorted(result.items()))


def weights_ok(weights: Sequence[Sequence[float | None]], r: int, c: int) -> bool:
    return weights[r][c] is not None

"""Which estimated shapes the exact predictor judges: the best distinct shapes overall plus
each family's best (estimates are rough; the predictor is the judge), the best by their
interleaved estimates, and, while the search runs, what a shape has to beat to get there
(Leaderboard)."""

from __future__ import annotations

from typing import Sequence

from hetero.search.options import FAMILIES, Candidate


def shape_key(c: Candidate) -> tuple:
    """What makes two candidates the same shape (they differ in layers and micro-batches)."""
    return (c.family, c.order, c.degrees, c.micro_batch_size, len(c.layers), len(c.replica_classes))


def distinct_shapes(candidates: Sequence[Candidate]) -> list[Candidate]:
    """One per (family, TP, micro-batch, stages, replicas), best first, so the exact
    predictor sees different shapes rather than near copies of one."""
    seen, out = set(), []
    for c in candidates:
        key = shape_key(c)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def shortlist(found: Sequence[Candidate], overall: int, per_family: int) -> list[Candidate]:
    """The `overall` best estimates among distinct shapes, plus each family's `per_family`
    best, each candidate once."""
    found = sorted(found, key=lambda c: (c.estimate_s, c.family, c.degrees, c.micro_batch_size))
    chosen = distinct_shapes(found)[:overall]
    for family in FAMILIES:
        chosen += distinct_shapes([c for c in found if c.family == family])[:per_family]
    unique, seen = [], set()
    for c in chosen:
        if id(c) not in seen:
            seen.add(id(c))
            unique.append(c)
    return unique


class BestDistinct:
    """The `size` best estimates among distinct shapes (shape_key), each shape at its best."""

    def __init__(self, size: int):
        self.size = size
        self.best: dict[tuple, float] = {}

    def add(self, key: tuple, estimate_s: float) -> None:
        if key in self.best:
            self.best[key] = min(self.best[key], estimate_s)
        elif len(self.best) < self.size:
            self.best[key] = estimate_s
        elif self.size:
            worst = max(self.best, key=self.best.__getitem__)
            if estimate_s < self.best[worst]:
                del self.best[worst]
                self.best[key] = estimate_s

    def bar(self) -> float:
        """An estimate above this cannot be among the `size` best: it only falls as shapes come."""
        if len(self.best) < self.size:
            return float("inf")
        return max(self.best.values(), default=float("-inf"))


class Leaderboard:
    """What a candidate has to beat to reach the shortlist: the best distinct shapes
    overall, or its family's; or, interleaved, the best distinct shapes by their
    interleaved estimates (interleaved_shortlist)."""

    def __init__(self, overall: int, per_family: int):
        self.overall = BestDistinct(overall)
        self.families = {family: BestDistinct(per_family) for family in FAMILIES}
        self.interleaved = BestDistinct(overall)

    def add(self, candidate: Candidate) -> None:
        key = shape_key(candidate)
        self.overall.add(key, candidate.estimate_s)
        self.families[candidate.family].add(key, candidate.estimate_s)
        if candidate.interleaved is not None:
            self.interleaved.add(key, candidate.interleaved[1])

    def bar(self, family: str) -> float:
        return max(self.overall.bar(), self.families[family].bar())

    def interleaved_bar(self) -> float:
        """An interleaved estimate above this cannot reach the interleaved shortlist, nor beat
        the shortlist's own estimates (which are judged interleaved too)."""
        return min(self.interleaved.bar(), self.overall.bar())


def interleaved_shortlist(found: Sequence[Candidate], overall: int, chosen: Sequence[Candidate]) -> list[Candidate]:
    """The `overall` best distinct shapes by their interleaved estimates, those not already
    `chosen`: the 1F1B estimate ranks shapes whose bubbles interleaving halves too low."""
    found = sorted((c for c in found if c.interleaved is not None),
                   key=lambda c: (c.interleaved[1], c.family, c.degrees, c.micro_batch_size))
    taken = {id(c) for c in chosen}
    return [c for c in distinct_shapes(found)[:overall] if id(c) not in taken]

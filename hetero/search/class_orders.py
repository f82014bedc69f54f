"""The orders in which a cross-class pipeline's stages visit the device classes.

A replica of a cross-class pipeline holds k_c stages of each class c. Laid out class after
class (all of one class, then all of the next) is one choice; the ends of a pipeline are
special, though: the first stage holds the embedding and runs the most micro-batches in
flight (the most activations), the last the logits and loss. A "sandwich" puts one class at
both ends and the others in the middle (Sailor's plans: the small-memory V100 stages at
both ends with a wide tensor-parallel degree, the A100 stages between them with a narrow
one). Which order wins depends on memory and speed, so the search tries a few:

- every contiguous order (all permutations for up to three classes, else grouped by fabric);
- where the classes' degrees differ, for each class of the widest degree with two or more
  stages, that class split around the other classes (its stages halved between the two ends, the odd one
  last, where the logits are), the others in the first contiguous order and its reverse.

Boundaries between classes cost transfers, and a sandwich has one more than a contiguous
order: the estimate prices them.
"""

from __future__ import annotations

from typing import Collection, Sequence

Pattern = tuple[int, ...]


def contiguous(order: Sequence[int], counts: dict[int, int]) -> Pattern:
    """The stages of each class in `order`, class after class."""
    return tuple(c for c in order for _ in range(counts[c]))


def sandwiches(orders: Sequence[Sequence[int]], counts: dict[int, int], outers: Collection[int]) -> list[Pattern]:
    """Patterns with one class of `outers` at both ends around the others (in the first of
    the contiguous `orders` and its reverse), its stages split in halves."""
    found: list[Pattern] = []
    for outer, k in counts.items():
        if k < 2 or len(counts) < 2 or outer not in outers:
            continue
        # the middle in the first contiguous order and its reverse: with many classes every
        # order of the middle would multiply the shapes the search judges
        first = tuple(c for c in orders[0] if c != outer)
        for inner in dict.fromkeys((first, first[::-1])):
            middle = contiguous(inner, counts)
            found.append((outer,) * (k // 2) + middle + (outer,) * (k - k // 2))
    return found


def stage_patterns(orders: Sequence[Sequence[int]], counts: dict[int, int],
                   degrees: dict[int, int] | None = None) -> list[Pattern]:
    """Every pattern a cross-class pipeline with k_c = counts[c] stages of class c is tried
    in: the contiguous ones, then, where the classes' tensor-parallel degrees (by class)
    differ, the sandwiches with a widest-degree class at the ends, each once. The ends
    hold the vocabulary-sized embedding and logits and the first stage the most
    activations in flight: the widest shards them most (Sailor's choice). With one degree
    a sandwich only adds a cross-class boundary to a contiguous order; the search spares
    those shapes, which would double the cross-class ones it judges."""
    patterns = [contiguous(order, counts) for order in orders]
    if len(set(degrees.values())) > 1:
        widest = max(degrees.values())
        patterns += sandwiches(orders, counts, {c for c, tp in degrees.items() if tp == widest})
    return list(dict.fromkeys(patterns))

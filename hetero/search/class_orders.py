"""The orders in which a cross-class pipeline's stages visit the device classes.

A replica of a cross-class pipeline holds k_c stages of each class c. Laid out class after
class (all of one class, then all of the next) is one choice; the ends of a pipeline are
special, though: the first stage holds the embedding and runs the most micro-batches in
flight (the most activations), the last the logits and loss. A "sandwich" puts one class at
both ends and the others in the middle (Sailor's plans: the small-memory V100 stages at
both ends with a wide tensor-parallel degree, the A100 stages between them with a narrow
one). Which order wins depends on memory and speed, so the search tries a few:

- every contiguous order (all permutations for up to three classes, else grouped by fabric);
- sandwiches: a class with two or more stages split around the other classes (its stages
  halved between the two ends, the odd one last, where the logits are), the others in the
  first contiguous order and its reverse. Where the classes' degrees differ, the outer class
  is one of the widest degree (it shards the vocabulary-sized ends most: Sailor's choice);
  at one degree, one of the classes with the most memory per device, which holds the first
  stage's activations in flight and the logits best and (usually) runs them fastest (on 8
  A100-40GB and 8 V100-16GB, GPT-Neo-2.7B, A,V,V,A is predicted 2-8% faster than A,A,V,V,
  whose last V100 stage runs the 50k-word logits).

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


def stage_patterns(orders: Sequence[Sequence[int]], counts: dict[int, int], degrees: dict[int, int],
                   memory_gib: dict[int, float] | None = None) -> list[Pattern]:
    """Every pattern a cross-class pipeline with k_c = counts[c] stages of class c is tried
    in: the contiguous ones, then the sandwiches, each once. The ends hold the vocabulary-
    sized embedding and logits and the first stage the most activations in flight: where
    the classes' tensor-parallel degrees (by class) differ, a widest-degree class goes to
    the ends (it shards them most: Sailor's choice); at one degree a class with the most
    memory per device (memory_gib by class; None: any class), at the price of one more
    cross-class boundary, which the estimate weighs."""
    patterns = [contiguous(order, counts) for order in orders]
    widest = max(degrees.values())
    outers = {c for c, tp in degrees.items() if tp == widest}
    if len(outers) == len(degrees) and memory_gib:  # one degree: the roomiest classes
        most = max(memory_gib[c] for c in outers)
        outers = {c for c in outers if memory_gib[c] == most}
    patterns += sandwiches(orders, counts, outers)
    return list(dict.fromkeys(patterns))

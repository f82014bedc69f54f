"""A snapshot's pieces: each a tensor of this rank's state with the box it covers in its
global tensor, taken from the state dicts (``take``) or again from live tensors by a recipe."""

from __future__ import annotations

import math
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from hetero.errors import HeteroError


@dataclass(frozen=True)
class Box:
    """Where a local tensor sits in its global tensor."""

    key: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]

    def intersect(self, other: "Box") -> "Box | None":
        if self.key != other.key or len(self.offset) != len(other.offset):
            return None
        lo = tuple(max(a, b) for a, b in zip(self.offset, other.offset))
        hi = tuple(min(a + n, b + m) for a, n, b, m in zip(self.offset, self.shape, other.offset, other.shape))
        if any(h <= l for l, h in zip(lo, hi)):
            return None
        return Box(self.key, lo, tuple(h - l for l, h in zip(lo, hi)))

    def slices_within(self, outer: "Box") -> tuple[slice, ...]:
        """This box's place inside ``outer`` (which contains it), as slices of outer's tensor."""
        return tuple(slice(o - p, o - p + n) for o, p, n in zip(self.offset, outer.offset, self.shape))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def box_of(sharded_tensor) -> Box:
    """The box of a megatron-core ShardedTensor in its global tensor: its prepended axes
    (a layer's place in the stack) are axes of extent 1."""
    if sharded_tensor.flattened_range is not None:
        raise HeteroError(f"{sharded_tensor.key}: a flattened shard cannot be snapshot; snapshots take the "
                          "optimizer in megatron-core's fully reshardable form")
    prepended = (1,) * sharded_tensor.prepend_axis_num
    return Box(sharded_tensor.key, tuple(sharded_tensor.global_offset), prepended + tuple(sharded_tensor.local_shape))


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Elements [start, stop) of a row-major tensor of ``shape``, as (offset, shape) boxes in
    element order: a partial first row, the full rows, a partial last row (each partial row
    cut the same way along the next axis). Each box is a contiguous run of the elements."""
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    rest = tuple(0 for _ in shape[1:])
    boxes, row = [], start // inner
    if start % inner:
        end = min(stop, (row + 1) * inner)
        boxes += [((row, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], start - row * inner, end - row * inner)]
        start, row = end, row + 1
    full_rows = (stop - start) // inner
    if full_rows:
        boxes.append(((row, *rest), (full_rows, *shape[1:])))
        start, row = start + full_rows * inner, row + full_rows
    if start < stop:
        boxes += [((row, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], 0, stop - start)]
    return boxes


class NotPerRank(HeteroError):
    """A tensor of the optimizer state that is not a contiguous slice of its flat shard."""


# Where an optimizer-state element range came from: (start, stop) in the flat state tensor,
# and fetch, key: fetch()[key] is the live 1-D shard of one parameter that fills it.
OwnShard = tuple[int, int, Callable[[], dict], str]
# A piece's live source: a view of a live tensor, or (fetch, key, start, numel) of a shard.
Source = torch.Tensor | tuple[Callable[[], dict], str, int, int]


def own_shard_pieces(sharded_tensor, filled: list[OwnShard]) -> dict[Box, tuple[torch.Tensor, Source]]:
    """The parts of ``sharded_tensor`` (a view into a flat optimizer-state tensor of which this
    rank filled the element ranges ``filled``) that hold this rank's data, as boxes: each a
    view of that flat tensor (no copy), with its live source."""
    data = sharded_tensor.data
    if not data.is_contiguous():
        raise NotPerRank(f"{sharded_tensor.key}: not a contiguous slice of the optimizer's flat state")
    whole = box_of(sharded_tensor)
    flat, first = data.reshape(-1), data.storage_offset()
    pieces = {}
    for lo, hi, fetch, key in filled:
        start, stop = max(lo, first) - first, min(hi, first + flat.numel()) - first
        at = start
        for offset, shape in flat_range_boxes(whole.shape, start, stop):
            box = Box(whole.key, tuple(a + b for a, b in zip(whole.offset, offset)), shape)
            pieces[box] = (flat[at:at + box.numel].view(shape), (fetch, key, first + at - lo, box.numel))
            at += box.numel
    return pieces


@dataclass
class Snapshot:
    """One rank's state at one iteration: its pieces (host memory) and the common state.
    ``packed``: the buffers (one per dtype) the pieces are views of, in ``layout`` order.
    ``without_twins``: the model tensors that the optimizer's main parameters hold are left
    out (``twins``); a restore takes them from those. Every rank's snapshots alike."""

    iteration: int
    taken_by: int                  # the logical rank that took it, in the world it was taken in
    host: str
    pieces: Mapping[Box, torch.Tensor] = field(default_factory=dict)
    common: dict = field(default_factory=dict)
    packed: dict[str, torch.Tensor] | None = None
    without_twins: bool = False

    @property
    def nbytes(self) -> int:
        held = self.packed.values() if self.packed is not None else self.pieces.values()
        return sum(t.numel() * t.element_size() for t in held)


@dataclass
class Recipe:
    """How this rank takes its snapshot again straight from the live tensors, without building
    any state dict: each piece's source, in layout order; each take is one copy per dtype.

    A take runs every snapshot (every iteration by default), so its host work is kept small:
    each piece's flat view of its live tensor is made once and kept while that tensor's memory
    stays where it was (one pointer compared per piece), one ``torch.cat`` per dtype copies
    them into buffers a dropped generation left (``into``; fresh memory faults in every page,
    which cost 80% of a take here), all outside the CPU emulation's torch-function mode: on a
    GPU these are host-side copies beside the device's compute, and on the emulator each torch
    call the mode wraps costs about as much as the copy of a piece."""

    boxes: list[Box]
    sources: list[Source]
    dtypes: list[str]
    without_twins: bool = False
    # Per piece: the memory address its view was made at, and the view (made at the first take).
    _views: list = field(default_factory=list, repr=False, compare=False)

    def take(self, iteration: int, common: dict, taken_by: int,
             into: dict[str, torch.Tensor] | None = None) -> Snapshot:
        if not self._views:
            self._views = [(None, None)] * len(self.sources)
        with torch._C.DisableTorchFunction():  # host copies only: nothing here names a device
            fetched: dict = {}
            flat: list[torch.Tensor] = []
            for i, source in enumerate(self.sources):
                if isinstance(source, torch.Tensor):
                    live = source
                else:
                    fetch, key, start, numel = source
                    if fetch not in fetched:  # one fetch per parameter, for all its states
                        fetched[fetch] = fetch()
                    live = fetched[fetch][key]
                address, view = self._views[i]
                if address != live.data_ptr():  # (None, None) before the first take
                    view = live.detach().reshape(-1)
                    if not isinstance(source, torch.Tensor):
                        view = view[start:start + numel]
                    # A view stays valid while its tensor's memory stays put (the view keeps
                    # that memory alive, so no other tensor can take its address); a reshape
                    # that had to copy is no view and is made again at every take.
                    self._views[i] = (live.data_ptr(), view) if live.is_contiguous() else (None, None)
                flat.append(view)
        packed = _pack_flat(flat, into)
        return Snapshot(iteration, taken_by, socket.gethostname(), unpack(packed, self.boxes, self.dtypes), common,
                        packed, self.without_twins)


def layout(pieces: dict[Box, torch.Tensor]) -> list[Box]:
    """The order a snapshot's pieces are packed and sent in: by dtype, then by box."""
    return sorted(pieces, key=lambda box: (str(pieces[box].dtype), box_order(box)))


def box_order(box: Box) -> tuple:
    return (box.key, box.offset, box.shape)


def pack(pieces: dict[Box, torch.Tensor], boxes: list[Box]) -> dict[str, torch.Tensor]:
    """The pieces in ``boxes`` order, copied into one flat host-memory buffer per dtype."""
    return _pack_flat([pieces[box].reshape(-1) for box in boxes])


def _pack_flat(flat: list[torch.Tensor], into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """1-D tensors, in order, copied into one host-memory buffer per dtype (one copy each:
    a GPU's are gathered there first): ``into``'s, where it has one of that dtype and length.
    Outside the CPU emulation's torch-function mode (Recipe.take says why); nothing here names
    a device."""
    parts: dict[str, list[torch.Tensor]] = {}
    packed = {}
    with torch._C.DisableTorchFunction():
        for tensor in flat:
            parts.setdefault(str(tensor.dtype), []).append(tensor)
        for dtype, tensors in parts.items():
            buffer = buffer_from(into, tensors[0].dtype, sum(t.numel() for t in tensors))
            if tensors[0].device.type == "cpu":
                packed[dtype] = torch.cat(tensors, out=buffer)
            else:
                packed[dtype] = buffer.copy_(torch.cat(tensors))
    return packed


def buffer_from(spare: dict[str, torch.Tensor] | None, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A host buffer of ``numel`` elements of ``dtype``: ``spare``'s of that dtype where its
    length fits (a dropped generation's, reused: fresh memory faults in every page), else a
    new one."""
    buffer = (spare or {}).get(str(dtype))
    if buffer is None or buffer.numel() != numel or buffer.dtype != dtype:
        return torch.empty(numel, dtype=dtype)
    return buffer


def unpack(buffers: dict[str, torch.Tensor], boxes: list[Box], dtypes: list[str]) -> Mapping[Box, torch.Tensor]:
    """The pieces of packed buffers (``pack``'s inverse): views, no copy, made when first
    looked at (most snapshots are dropped unread; their boxes are known without them)."""
    return PackedPieces(buffers, boxes, dtypes)


class PackedPieces(Mapping):
    """A snapshot's pieces as views of its packed buffers, in layout order (``unpack``)."""

    def __init__(self, buffers: dict[str, torch.Tensor], boxes: list[Box], dtypes: list[str]) -> None:
        self._buffers, self._boxes, self._dtypes = buffers, boxes, dtypes
        self._views: dict[Box, torch.Tensor] | None = None

    def __iter__(self) -> Iterator[Box]:
        return iter(self._boxes)

    def __len__(self) -> int:
        return len(self._boxes)

    def __getitem__(self, box: Box) -> torch.Tensor:
        if self._views is None:
            at = dict.fromkeys(self._buffers, 0)
            views = {}
            with torch._C.DisableTorchFunction():  # views of host buffers (Recipe.take says why)
                for each, dtype in zip(self._boxes, self._dtypes):
                    numel = each.numel
                    views[each] = self._buffers[dtype][at[dtype]:at[dtype] + numel].view(each.shape)
                    at[dtype] += numel
            self._views = views
        return self._views[box]


# The distributed optimizer's copy of model tensor K (its main parameter) is the sharded
# tensor OPTIMIZER_PARAM + K, in K's own coordinates (megatron-core's fully reshardable form).
OPTIMIZER_PARAM = "optimizer.state.param."


def _tensors(sharded_state: dict) -> list:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return [v for v in nested_values(sharded_state) if isinstance(v, ShardedTensor) and v.data is not None]


def twins(sharded_state: dict) -> frozenset[str]:
    """The model tensors whose values the optimizer's main parameters hold (the keys K that
    have an OPTIMIZER_PARAM + K) on this rank: a restore takes them from those, as the
    optimizer itself writes its main parameters into the model after each step."""
    return frozenset(value.key[len(OPTIMIZER_PARAM):] for value in _tensors(sharded_state)
                     if value.key.startswith(OPTIMIZER_PARAM))


def twins_agree(sharded_state: dict, snapshot: Snapshot) -> bool:
    """Whether the model's tensors equal their optimizer copies (cast to the model's dtype)
    wherever this rank's snapshot holds such a copy: each rank checks its own shard, so the
    ranks together check every element. Not so where the model's weights are not the
    optimizer's main parameters (quantized parameters, a precision-aware optimizer)."""
    models: dict[str, list] = {}
    for value in _tensors(sharded_state):
        models.setdefault(value.key, []).append(value)
    for box, piece in snapshot.pieces.items():
        if not box.key.startswith(OPTIMIZER_PARAM):
            continue
        region = Box(box.key[len(OPTIMIZER_PARAM):], box.offset, box.shape)
        inside = [v for v in models.get(region.key, []) if region.intersect(box_of(v)) == region]
        if not inside:
            return False
        whole = box_of(inside[0])
        model = inside[0].data.detach().reshape(whole.shape)[region.slices_within(whole)]
        if not torch.equal(model.cpu(), piece.to(model.dtype)):
            return False
    return True


def take(sharded_state: dict, common: dict, iteration: int, own_shards: dict[int, list[OwnShard]] | None = None,
         without_twins: bool = False) -> tuple[Snapshot, Recipe]:
    """This rank's snapshot of a sharded state dict (hetero's checkpoint state, preprocessed
    by megatron-core's save_preprocess: factories applied, common part apart), and the recipe
    that takes it again from the live tensors.

    ``own_shards`` (from patches.snapshot_in_progress) says which flat optimizer-state tensors
    hold only this rank's shard, and where: of those, each rank keeps its own part, so the
    distributed optimizer's state is snapshot where it lives, with no gather. Raises
    NotPerRank when such a tensor is not a contiguous slice of its flat state. With
    ``without_twins``, the model tensors that the optimizer's main parameters hold are left out."""
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    left_out = twins(sharded_state) if without_twins else frozenset()
    taken: dict[Box, tuple[torch.Tensor, Source]] = {}
    for value in _tensors(sharded_state):
        if value.key in left_out:
            continue
        filled = (own_shards or {}).get(value.data.untyped_storage().data_ptr())
        if filled is not None:
            for box, piece in own_shard_pieces(value, filled).items():
                taken.setdefault(box, piece)
        elif is_main_replica(value.replica_id):
            # Kept by one rank, as a checkpoint writes it once: the data-parallel replicas'
            # identical copies add no safety the copies on other nodes do not give.
            box = box_of(value)
            if box not in taken:
                taken[box] = (value.data.detach().reshape(box.shape), value.data)
    pieces = {box: tensor for box, (tensor, _) in taken.items()}  # views: pack copies them, once
    boxes = layout(pieces)
    packed = pack(pieces, boxes)
    dtypes = [str(pieces[box].dtype) for box in boxes]
    snapshot = Snapshot(iteration, dist.get_rank(), socket.gethostname(), unpack(packed, boxes, dtypes), common, packed,
                        without_twins)
    return snapshot, Recipe(boxes, [taken[box][1] for box in boxes], dtypes, without_twins)

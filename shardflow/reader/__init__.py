"""The read path: from a worker's planned shards to its samples.

One pass of one worker goes through these modules in order:

* :mod:`.runs`: which stretches of which shards to read (runs), computed once.
* :mod:`.streams` and :mod:`.segments`: opening a run's byte stream (seeking
  with the offset index or reading from the shard's start), opening the next
  ones ahead.
* :mod:`.planned`: the main loop, stepping through the read positions.
* :mod:`.recovery`: the slow path (a stream to open, an error, a shard cut short).
* :mod:`.phases`: the first batch's samples read first where that helps.
* :mod:`.shards`: reading without a plan (no manifest), and putting planned
  reads back into yield order.
* :mod:`.samples`: :class:`Prepare` (select, tag, decode, expand: the one per-sample
  path), the transform, batching.

Errors go to one :class:`~shardflow.policy.ErrorPolicy`. See docs/architecture.md
for a sample's whole trip.
"""

from .phases import PHASE_RATIO, first_phase, read_planned_in_phases
from .planned import read_planned
from .runs import REMOTE_SEEK_BYTES, SEEK_GAP
from .scattered import read_scattered
from .samples import Prepare, apply_transform, batched, check_fields, expand_each, prepared, tag_source, transform_error
from .shards import emit_in_order, read_shards

__all__ = [
    "read_planned",
    "read_planned_in_phases",
    "read_scattered",
    "first_phase",
    "PHASE_RATIO",
    "read_shards",
    "emit_in_order",
    "Prepare",
    "prepared",
    "tag_source",
    "check_fields",
    "apply_transform",
    "transform_error",
    "expand_each",
    "batched",
    "SEEK_GAP",
    "REMOTE_SEEK_BYTES",
]

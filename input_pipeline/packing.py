"""Concat packing, a whole batch at a time.

Custom, not Grain's ConcatThenSplit: that chain (+ a per-row map + `.batch`) ran at 0.03x of the
raw read rate (BENCHMARKS.md, "Input pipeline alone"), and it has no documents-per-row bound.
Records are concatenated into one stream of next-token pairs cut into rows of `seq_len`; a batch
is the next `batch_size * seq_len` pairs, built with O(records + rows) numpy calls and no
per-token Python.

Batches are exactly what ConcatThenSplit + padded `.batch` gave: the same tokens in the same
order, a document cut at a row end goes on at position 0 of the next row, segment ids restart at
1 per row, 0 is padding, and the data's end is padded with zero-weight rows. One difference: a
record with no pairs (impossible from `prepare`) is skipped here, where ConcatThenSplit spent a
segment id on it.

`max_docs_per_row` bounds the pieces (segment ids) of a row, as the packed-document attention
kernel takes a static count: when the piece that reaches the bound ends inside its row, the rest
of that row is padding and the next document starts the next row. No document is merged or
dropped; with the bound never reached, batches are the ones above.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np

from input_pipeline.positions import DamagedPositionError

# {"inputs", "targets"}: a document's next-token pairs, any integer dtype (widened to int32 as
# they are copied into the batch, so a reader can hand over views of the stored narrow tokens).
Record = Mapping[str, np.ndarray]
FIELDS = {
    "inputs": np.int32,
    "targets": np.int32,
    "segment_ids": np.int32,
    "positions": np.int32,
    "weights": np.float32,
}


def blank_batch(rows: int, seq_len: int) -> dict[str, np.ndarray]:
    """All-padding rows of `FIELDS`: what an eval stream with no records yields."""
    return {name: np.zeros((rows, seq_len), dtype) for name, dtype in FIELDS.items()}


def check_rows(seq_len: int, batch_size: int, max_docs_per_row: int | None) -> None:
    """A `ValueError` for rows no packer can make: the check a library caller's packing
    arguments get (a run's are checked as its config is read)."""
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len={seq_len} and batch_size={batch_size} must be >= 1")
    if max_docs_per_row is not None and max_docs_per_row < 1:
        raise ValueError(f"max_docs_per_row={max_docs_per_row} must be >= 1 (or None)")


class ConcatPackIterDataset(grain.IterDataset):
    """Decoded records -> whole `[B, L]` batches of `FIELDS` (the batch contract, pipeline.py).

    A parent element is one record, or a sequence of records read together (one Grain element
    per read keeps Grain's per-element cost off the per-record path)."""

    def __init__(
        self,
        parent: grain.IterDataset,
        *,
        seq_len: int,
        batch_size: int,
        max_docs_per_row: int | None = None,
    ):
        super().__init__(parent)
        check_rows(seq_len, batch_size, max_docs_per_row)
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.max_docs_per_row = max_docs_per_row

    def __iter__(self) -> grain.DatasetIterator:
        return ConcatPackIterator(
            self._parent.__iter__(), self.seq_len, self.batch_size, self.max_docs_per_row
        )

    def __str__(self) -> str:
        return (
            f"ConcatPackIterDataset(seq_len={self.seq_len}, batch_size={self.batch_size}, "
            f"max_docs_per_row={self.max_docs_per_row})"
        )


class ConcatPackIterator(grain.DatasetIterator):
    """The packer. Its state is the parent's state from before the element being consumed, the
    record within that element and the pairs of it already packed: restoring re-reads that one
    element and goes on at the same pair, so the next batch is the one that would have come.
    (A batch always starts at a row start, so the pieces of a row need no state.)"""

    def __init__(
        self,
        parent: grain.DatasetIterator,
        seq_len: int,
        batch_size: int,
        max_docs_per_row: int | None = None,
    ):
        super().__init__(parent)
        self._shape = (batch_size, seq_len)
        self._max_pieces = max_docs_per_row or batch_size * seq_len  # None: never reached
        self._size = batch_size * seq_len
        self._row_positions = np.arange(seq_len, dtype=np.int32)
        # Most rows lie inside one document: positions 0..L-1 and segment id 1 throughout.
        self._positions = np.tile(self._row_positions, batch_size)
        self._element: Sequence[Record] = ()  # the parent element being consumed
        self._element_state: dict[str, Any] | None = None  # parent state from before it
        self._record = 0  # index of the record being consumed within the element
        self._offset = 0  # pairs of that record already packed
        self._exhausted = False

    def _current_record(self) -> Record | None:
        """The record to pack from next, reading parent elements as needed; None at the end."""
        while self._record >= len(self._element):
            if self._exhausted:
                return None
            state = self._parent.get_state()
            try:
                element = next(self._parent)
            except StopIteration:
                self._exhausted = True
                return None
            self._set_element(element, state)
        return self._element[self._record]

    def _set_element(self, element: Record | Sequence[Record], state: dict[str, Any]) -> None:
        self._element = (element,) if isinstance(element, Mapping) else element
        self._element_state = state
        self._record = 0
        self._offset = 0

    def __next__(self) -> dict[str, np.ndarray]:
        self._assert_not_closed()
        fields = {name: np.empty(self._size, dtype) for name, dtype in FIELDS.items()}
        inputs, targets = fields["inputs"], fields["targets"]
        seq_len = self._shape[1]
        document_starts = []  # flat offsets where a document begins inside this batch
        gaps = []  # (start, stop): padding after a row's `max_docs_per_row`-th piece
        pieces, pieces_row = 0, -1  # pieces so far in the row of the latest document start
        filled = 0
        while filled < self._size:
            record = self._current_record()
            if record is None:
                break
            record_inputs = record["inputs"]
            take = min(len(record_inputs) - self._offset, self._size - filled)
            if take <= 0:  # a record with no pairs
                self._record, self._offset = self._record + 1, 0
                continue
            end, stop = filled + take, self._offset + take
            inputs[filled:end] = record_inputs[self._offset : stop]
            targets[filled:end] = record["targets"][self._offset : stop]
            if self._offset == 0:
                document_starts.append(filled)
                pieces, pieces_row = _count_piece(filled, seq_len, pieces, pieces_row)
            filled, self._offset = end, stop
            if self._offset >= len(record_inputs):
                self._record, self._offset = self._record + 1, 0
                row_end = self._row_end_if_full(filled, pieces, pieces_row)
                if row_end > filled:
                    gaps.append((filled, row_end))
                    filled = row_end
        if filled == 0:
            raise StopIteration
        if filled < self._size:  # the data ended: the rest is padding
            gaps.append((filled, self._size))
        self._fill_pieces(fields, document_starts)
        for start, stop in gaps:
            for array in fields.values():
                array[start:stop] = 0
        return {name: array.reshape(self._shape) for name, array in fields.items()}

    def _row_end_if_full(self, filled: int, pieces: int, pieces_row: int) -> int:
        """Where the next document starts once one ends at `filled`: the next row's start when
        this row already holds `max_docs_per_row` pieces (a document that began in an earlier
        row is this row's first), else right here."""
        seq_len = self._shape[1]
        in_row = pieces if pieces_row == (filled - 1) // seq_len else 1
        return -(-filled // seq_len) * seq_len if in_row >= self._max_pieces else filled

    def _fill_pieces(self, fields: dict[str, np.ndarray], document_starts: list[int]):
        """Segment ids, positions and weights: whole-row defaults, then from each document start
        inside a row, the next segment id and positions from 0. O(rows) work per batch, plus two
        slices per document start."""
        seq_len = self._shape[1]
        segment_ids = fields["segment_ids"].reshape(self._shape)
        positions = fields["positions"]
        segment_ids.fill(1)
        positions[:] = self._positions
        fields["weights"].fill(1.0)
        for start in document_starts:
            row, column = divmod(start, seq_len)
            if column:
                rest = seq_len - column
                segment_ids[row, column:] += 1
                positions[start : start + rest] = self._row_positions[:rest]

    def get_state(self) -> dict[str, Any]:
        if self._record < len(self._element):
            parent, record, offset = self._element_state, self._record, self._offset
        else:  # nothing pending: the parent's own position says it all
            parent, record, offset = self._parent.get_state(), 0, 0
        return {"parent": parent, "record": record, "offset": offset}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["parent"])
        self._element, self._element_state = (), None
        self._record, self._offset, self._exhausted = 0, 0, False
        if state["record"] or state["offset"]:
            try:
                element = next(self._parent)
            except StopIteration:
                raise ValueError(f"{self}: the data ended before the saved position") from None
            self._set_element(element, state["parent"])
            self._record, self._offset = self._inside_element(state["record"], state["offset"])

    def _inside_element(self, record: int, offset: int) -> tuple[int, int]:
        """A saved record and offset, once checked to point inside the element just re-read: one
        past it would be moved on from in silence, to the next record or element."""
        if not 0 <= record < len(self._element):
            raise DamagedPositionError(
                f"the concat packer's record is {record}, not one of the {len(self._element)} "
                "records of its read"
            )
        pairs = len(self._element[record]["inputs"])
        if not 0 <= offset < max(pairs, 1):  # a record with no pairs is at offset 0
            raise DamagedPositionError(
                f"the concat packer's offset is {offset}, not inside the {pairs} pairs of its "
                "record"
            )
        return record, offset

    def __str__(self) -> str:
        return f"ConcatPackIterator(batch={self._shape}, max_docs_per_row={self._max_pieces})"


def _count_piece(start: int, seq_len: int, pieces: int, pieces_row: int) -> tuple[int, int]:
    """The pieces of its row once a document starts at flat offset `start`, and that row: a
    document starting mid-row after one that began in an earlier row is the row's second piece."""
    row, column = divmod(start, seq_len)
    if column == 0:
        return 1, row
    return (pieces + 1 if row == pieces_row else 2), row

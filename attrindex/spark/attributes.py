"""The ``attrindex.attributes`` data source (a segment's key/value attributes) and ``lookup``.

Writes are bulk ``REPLACE`` updates (a null value removes the key); replaying them sets the same
values again, so task retries and duplicate attempts cannot change the outcome of a write whose
input is the same. Reads split the key space at the B+tree's upper separator keys.

Writes go through the segment's log, never straight into its B+tree with ``bulk_load``: the log
is what every writer's conditional appends validate against (a tree written beside it would be a
second truth). The log's tier 1 reaches the tree in large sorted merges; into an empty tree such a
merge writes full leaves in one append, as a bulk load does, at the same speed (1M keys: 0.44 s
against 0.43 s, measured). On local disk the tasks of a write take turns (``turns``).

Memory per Python worker is bounded by options, never by the rows of a task or of the segment: a
write task holds one append's updates (``WRITE_BATCH`` plus one Arrow batch) and its handle's tier
1 (``maxPendingBytes``); a lookup task holds ``batch_rows`` input rows and their keys; a read task
``READ_BATCH`` pairs; every handle's page cache is ``TASK_CACHE_BYTES``, and it keeps no value cache
(docs/spark.md).
"""

from __future__ import annotations

import attrs
from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, DataSourceReader, InputPartition, WriterCommitMessage
from pyspark.sql.types import BinaryType, ByteType, IntegerType, LongType, ShortType, StringType, StructField, StructType

from ..errors import InvalidInputError
from .checks import check_write_target, refuse_single_writer
from .options import Options

SOURCE = "attrindex.attributes"
ATTRIBUTES_DDL = "key binary, value long"
KEY_TYPES = (BinaryType, StringType, LongType, IntegerType, ShortType, ByteType)
READ_BATCH = 10_000
WRITE_BATCH = 100_000  #: updates per durable append while bulk loading
LOOKUP_BATCH_ROWS = 100_000  #: input rows per batched lookup (sorted, they share page reads)
#: The B+tree page cache of a task's handle, in decoded memory (``tree_index.page_memory``): about
#: the index pages of a 100M-key tree (63 pages of about 330 KB decoded) and a few leaves. A task
#: reads a leaf once per sorted batch of lookups or merge, so more cache would only hold more leaves.
TASK_CACHE_BYTES = 32 << 20
#: The B+tree options of a task's handle. No value cache: a lookup puts every value it read in it (up
#: to 2Mi entries, ~140 B each), as a merge of up to 10k keys does every value it wrote, and a task
#: rarely reads a key twice.
TASK_TREE_OPTIONS = {"cache_bytes": TASK_CACHE_BYTES, "value_cache_entries": 0}
MIN_PENDING_BYTES = 1 << 20


@attrs.frozen
class AttributeTarget:
    url: str
    segment: str
    storage_options: dict
    key_column: str = "key"
    value_column: str = "value"
    partitions: int = 8
    max_pending_bytes: int | None = None  #: tier 1's limit in a write task's handle (None: the store's default)

    def open_store(self):
        from ..store import SegmentStore

        options: dict = {"attribute_options": TASK_TREE_OPTIONS}
        if self.max_pending_bytes is not None:
            options["max_pending_bytes"] = self.max_pending_bytes
        return SegmentStore.open(self.url, storage_options=dict(self.storage_options), **options)


def _target(raw) -> AttributeTarget:
    options = Options(raw, SOURCE)
    return AttributeTarget(
        url=options.required("path", "the storage URL of the store"),
        segment=options.required("segment", "the segment whose attributes to read or write"),
        storage_options=options.storage_options(),
        key_column=options.text("keyColumn", "key"),
        value_column=options.text("valueColumn", "value"),
        partitions=options.integer("partitions", 8, minimum=1),
        max_pending_bytes=options.integer("maxPendingBytes", None, minimum=MIN_PENDING_BYTES),
    )


def check_key_column(schema: StructType, name: str, source: str = SOURCE) -> None:
    _check(schema, name, KEY_TYPES, "16-byte binary, a UUID string or an integer >= 0", source)


def _check(schema: StructType, name: str, types: tuple, wanted: str, source: str) -> None:
    fields = {f.name.lower(): f for f in schema.fields}
    field = fields.get(name.lower())
    if field is None:
        raise InvalidInputError(f"{source}: no column {name!r} in the DataFrame (columns: {', '.join(fields)})")
    if not isinstance(field.dataType, types):
        raise InvalidInputError(f"{source}: column {name!r} has type {field.dataType.simpleString()}; "
                                f"it must be {wanted}")


class _Done(WriterCommitMessage):
    def __init__(self, updates: int):
        self.updates = updates


class AttributesWriter(DataSourceArrowWriter):
    def __init__(self, target: AttributeTarget, schema: StructType):
        check_key_column(schema, target.key_column)
        _check(schema, target.value_column, (LongType, IntegerType, ShortType, ByteType), "an integer (long)", SOURCE)
        self.target = target
        check_write_target(target.url, target.storage_options, SOURCE)  # here, not in every task
        with target.open_store() as store:
            store.segment(target.segment, create=True)

    def write(self, iterator):
        from .arrow import attribute_keys, attribute_values, column_named
        from .turns import writer_turn

        t = self.target
        count = 0
        with t.open_store() as store, writer_turn(store.storage, t.segment):
            segment = store.segment(t.segment)  # opened in this task's turn: merged up to the last turn's end
            try:
                pending: list[tuple] = []
                for batch in iterator:
                    keys = attribute_keys(column_named(batch, t.key_column), t.key_column)
                    if None in keys:
                        raise InvalidInputError(f"{SOURCE}: the key column {t.key_column!r} holds nulls")
                    pending.extend(zip(keys, attribute_values(column_named(batch, t.value_column), t.value_column)))
                    if len(pending) >= WRITE_BATCH:
                        segment.update_attributes(pending)
                        count += len(pending)
                        pending = []
                if pending:
                    segment.update_attributes(pending)
                    count += len(pending)
            finally:
                segment.close()  # what it wrote merged into the B+tree before the turn passes on
        return _Done(count)

    def commit(self, messages):
        pass  # every update is durable once its task's write returned

    def abort(self, messages):
        pass  # updates already made stay: they are idempotent, and a rerun sets the same values


class _KeyRange(InputPartition):
    def __init__(self, start: bytes | None, stop: bytes | None):
        super().__init__((start, stop))


class AttributesReader(DataSourceReader):
    def __init__(self, target: AttributeTarget):
        self.target = target
        with target.open_store() as store:
            store.segment(target.segment)  # SegmentNotFoundError names it

    def partitions(self):
        with self.target.open_store() as store:
            cuts = store.segment(self.target.segment).attribute_split_keys(self.target.partitions)
        bounds = [None, *cuts, None]
        return [_KeyRange(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]

    def read(self, partition):
        from .arrow import attributes_batch

        start, stop = partition.value
        with self.target.open_store() as store:
            pairs = []
            for pair in store.segment(self.target.segment).attributes(start, stop):
                pairs.append(pair)
                if len(pairs) >= READ_BATCH:
                    yield attributes_batch(pairs)
                    pairs = []
            if pairs:
                yield attributes_batch(pairs)


class AttributesDataSource(DataSource):
    """``spark.read/write.format("attrindex.attributes")``: one segment's ``key, value`` pairs."""

    @classmethod
    def name(cls):
        return SOURCE

    def schema(self):
        # Spark asks for the schema at load(), before any reader exists: refuse bad storage options here.
        Options(self.options, SOURCE).storage_options()
        return ATTRIBUTES_DDL

    def reader(self, schema):
        return AttributesReader(_target(self.options))

    def writer(self, schema, overwrite):
        if overwrite:
            raise InvalidInputError(f"{SOURCE}: attribute writes update keys in place; use .mode('append')")
        return AttributesWriter(_target(self.options), schema)


def lookup(df, key_col: str, url: str, segment: str, value_col: str = "value", storage_options=None, *,
           batch_rows: int = LOOKUP_BATCH_ROWS):
    """``df`` with a column ``value_col`` (long): the value of ``key_col`` in ``segment``'s
    attributes, null where the key is absent (or null). Runs as ``mapInArrow``, one store handle
    per partition; the keys of up to ``batch_rows`` input rows are looked up at once (sorted, so
    keys on one B+tree page share its read), and those rows are what a task holds.

    The segment must exist (``SegmentNotFoundError`` now, not from every task). That check runs
    where reads do: on the driver of a classic session, on the cluster under Spark Connect (the
    client need not reach the store). Nothing is created: a missing store is a missing segment.
    """
    from . import remote

    check_key_column(df.schema, key_col, "lookup")
    if value_col.lower() in (f.name.lower() for f in df.schema.fields):
        raise InvalidInputError(f"lookup: the DataFrame has a column {value_col!r} already; pick another value_col")
    if type(batch_rows) is not int or batch_rows < 1:
        raise InvalidInputError(f"lookup: batch_rows must be an int >= 1, got {batch_rows!r:.60}")
    options = dict(storage_options or {})
    refuse_single_writer(options, "lookup")
    remote.run(df.sparkSession, check_segment, url, segment, options)
    schema = StructType([*df.schema.fields, StructField(value_col, LongType(), nullable=True)])  # df.schema stays as is

    def look_up(batches):
        from ..store import SegmentStore

        with SegmentStore.open(url, storage_options=options, mode="r+", attribute_options=TASK_TREE_OPTIONS) as opened:
            handle = opened.segment(segment)
            held, rows = [], 0
            for batch in batches:
                held.append(batch)
                rows += batch.num_rows
                if rows >= batch_rows:
                    yield from _looked_up(handle, held, key_col, value_col)
                    held, rows = [], 0
            if held:
                yield from _looked_up(handle, held, key_col, value_col)

    return df.mapInArrow(look_up, schema)


def _looked_up(handle, batches: list, key_col: str, value_col: str):
    """``batches`` with the column ``value_col`` appended: their keys' values, in one lookup."""
    import pyarrow as pa

    from .arrow import attribute_keys, column_named

    keys = [attribute_keys(column_named(batch, key_col), key_col) for batch in batches]
    found = iter(handle.get_attributes([k for each in keys for k in each if k is not None]))
    for batch, each in zip(batches, keys):
        values = [None if k is None else next(found) for k in each]
        yield batch.append_column(value_col, pa.array(values, pa.int64()))


def check_segment(url: str, segment: str, storage_options: dict) -> None:
    """``SegmentNotFoundError`` unless segment ``segment`` exists in the store at ``url`` (which is
    opened without creating anything)."""
    from ..errors import SegmentNotFoundError, StoreNotFoundError
    from ..store import SegmentStore

    try:
        with SegmentStore.open(url, storage_options=storage_options, mode="r+") as store:
            store.segment(segment)
    except StoreNotFoundError as exc:
        raise SegmentNotFoundError(f"segment {segment!r} does not exist: {exc}") from None

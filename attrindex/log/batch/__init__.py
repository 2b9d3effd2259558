"""Record batches of the segment log: a codec that does no I/O (records in, bytes out, and back).

A batch is a fixed 64-byte header and a payload; docs/format.md has the layout byte by byte. The
header has its own checksum, so a reader tells a torn tail (a valid header whose payload is not
all there yet) from garbage (a header that fails its checksum). That checksum is seeded with where
the batch lies (the CRC-32 of the position as a little-endian u64, then bytes 0..59, as B+tree
pages and footers are), so a batch is valid at one position only: stale bytes, or a batch copied
or moved elsewhere, never pass for data there. ``chain.place_batches`` seals batches for where they
land; the encoders seal for position 0 unless told another. The payload is columnar so that
both directions run on C-level bulk operations: value lengths (varints), all values as one blob,
then the optional key, timestamp, header and tombstone columns, then the attribute updates, whose
size is fixed (25 bytes each) so they sit at a known place at the end of the payload. A tombstone
(``Record(value=None, key=...)``: the key is deleted, Kafka's null value) is a record whose byte in
the tombstones column is 1; batches without tombstones have no such column, so they are byte for
byte what they were before tombstones existed.

One job per module, each importing only the ones listed before it:

* ``compression``: the payload codecs (none, gzip, zstd, lz4) and their strict decompression;
* ``header``: the header layout and limits, ``BatchHeader``, reading, checking and sealing a header;
* ``records``: ``Record`` and the checks and normalisation of what callers append;
* ``chain``: batches back to back: iterating them, where a valid chain ends, placing them at a position;
* ``encode``: records and attribute updates to a batch, renumbering one, batch ids;
* ``decode``: a batch's payload to records, keys, columns and attribute updates.
"""

"""The segment log: an append-only sequence of record batches (codecs only here, no I/O)."""

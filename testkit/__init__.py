"""Tools shared by the test suite (``tests/``) and the simulations (``sims/``).

``history`` (a recorder of concurrent operations and the checker of what the stored state must
hold), ``changelog_history`` (the checker for compacted segments), ``moto_server`` (moto's S3
server on 127.0.0.1, with atomic conditional writes, and its launcher) and ``s3_requests``
(counting the requests an S3 storage sends). Nothing here imports ``tests`` or ``sims``.
"""

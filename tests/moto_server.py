"""moto's S3 server for the tests, with its conditional writes made atomic.

moto 5 checks ``If-None-Match: *`` and then stores the object as two steps of Python: a thread
switch between them (likely under load) lets two "exclusive" creates of one key both succeed, the
later one replacing the earlier. Real S3 (whose exclusive create this project's appends rely on)
never does that. It made ``test_free_for_all_appends...[s3]`` fail under load with two chunks
covering one range: 6 of 200 rounds of 8 concurrent exclusive PUTs on one key had two winners
with a 1 µs switch interval (0 with the lock below). Run as a script with moto.server's arguments.
"""

from __future__ import annotations

import sys
import threading

from moto.s3.responses import S3Response

_CONDITIONAL_WRITES = threading.Lock()


def _atomic(method):
    def run(self, *args, **kwargs):
        with _CONDITIONAL_WRITES:  # the existence check and the store as one step
            return method(self, *args, **kwargs)
    run.__name__ = method.__name__
    return run


S3Response.put_object = _atomic(S3Response.put_object)  # PutObject (If-None-Match checked inside)
S3Response._key_response_post = _atomic(S3Response._key_response_post)  # CompleteMultipartUpload, likewise

if __name__ == "__main__":
    from moto.server import main

    main(sys.argv[1:])

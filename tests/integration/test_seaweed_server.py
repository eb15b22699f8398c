"""The test S3 server itself: what the session's tests rely on from it.

Every S3 test makes a bucket of its own on the one ``weed mini`` a session starts, and weed gives
each bucket volumes of its own. With mini's automatic volume limit, puts into about the thirtieth
bucket answered 500 InternalError, so whichever tests came late on a worker failed with a store
error that had nothing to do with them (a CI run lost eleven that way).
"""

from __future__ import annotations

from tests.seaweed import SeaweedServer

# Half again the old limit (about 30): enough to see it, without a minute of volume growth.
BUCKETS = 45


def test_the_session_s3_server_takes_writes_into_as_many_buckets_as_a_session_makes(
    s3_server: SeaweedServer,
) -> None:
    # The buckets are kept, as the suite's tests keep theirs (deleting one frees its volumes).
    client = s3_server.client()
    for i in range(BUCKETS):
        bucket = s3_server.bucket()
        client.put_object(Bucket=bucket, Key="k", Body=b"%d" % i)
        assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == b"%d" % i

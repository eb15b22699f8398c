"""``s3://bucket/prefix``: any S3-compatible object store (AWS S3, R2, B2, MinIO, SeaweedFS...).

Credentials, region and endpoint come from boto3's standard configuration (``AWS_*``
environment variables including ``AWS_ENDPOINT_URL``, ``~/.aws/config``, profiles); the
``endpoint_url`` argument overrides the endpoint. Any endpoint that is not AWS's own is
addressed path-style (``http://host/bucket/key``): most S3-compatible servers have no wildcard
DNS for virtual-hosted buckets.

Uploads verify without downloading. Every body goes out with a checksum the server checks, so
it refuses a body that arrived different from what was read; which checksum depends on what the
store verifies, found out once per store by a probe (``checksum="auto"``, the default):

- ``crc32``: S3's flexible checksums (``x-amz-checksum-crc32``), where the store refuses a body
  whose CRC32 is deliberately wrong (SeaweedFS 4.48, tested; AWS documents it). Each part's
  CRC32 is checked on arrival and again when the upload is completed, and the object's
  composite CRC32 (``crc32(part CRC32s)-N``) must be what was sent. CRC32 costs a sixth of
  MD5's CPU, which matters on a box whose cores the training job needs.
- ``md5``: ``Content-MD5`` on every body, for stores that ignore flexible checksums; after
  completion the ETag must be the MD5 of the object (one put) or ``md5(part MD5s)-N``.

``put_file`` hashes exactly the bytes it sends: their sha256 must equal the caller's (otherwise
the file changed after the caller hashed it, and the upload is aborted). The sha256 is stored as
``x-amz-meta-sha256`` so ``stat`` returns it. A multipart upload is atomic at completion, so
aborting on any failure leaves nothing under the final key.

Conditional writes fence the run's documents: ``put_bytes(if_absent=True)`` sends
``If-None-Match: *`` and ``put_bytes(if_match=ETAG)`` sends ``If-Match`` (AWS supports both
since 2024; SeaweedFS 4.48 refuses either with 412 when it does not hold, tested). A store that
answers NotImplemented gets a HEAD and a compare before a plain put instead, which is not
atomic; the sealer's read-back after every document write covers that.

boto3 is an optional extra (``pip install remote-gpu-trainer[s3]``): this module is imported
only when an ``s3://`` URL is used. boto3 >= 1.35 is needed for ``If-None-Match`` puts.

Small objects go out on a lean path: a whole-object put without conditions, to any endpoint
but AWS's own, is signed by botocore's SigV4 signer and sent on the client's own connection pool
without boto3's per-call layers (serialisation, endpoint rules, events, model parsing), which
cost three times s5cmd's client CPU per request and limited a seal of many small files. It
sends the same headers, is verified the same way and fails with the same errors (``lean``).

The package, by job: ``core`` (S3Store: the client, puts, reads, list, delete), ``client`` (how
boto3's client is configured), ``lean`` (the lean PUT), ``errors`` (what botocore's exceptions
and the store's codes mean), ``conditional`` (the conditional puts), ``checksums`` (the protocol
above), ``multipart`` (part sizes,
parallel parts, completion) and ``preflight``.
"""

from onbox.sealing.stores.s3.core import S3Store
from onbox.sealing.stores.s3.multipart import part_size_for

__all__ = ["S3Store", "part_size_for"]

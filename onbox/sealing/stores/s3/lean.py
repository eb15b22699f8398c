"""The lean requests of an S3Store (see the package docstring): the PUT of one whole object
without conditions and the HEAD and GETs of a download (whole or ranged), each the request
S3Store's boto3 client would send for ``put_object``, ``head_object`` or ``get_object``,
built and sent without boto3's per-call machinery.

Why: a checkpoint of 10,000 small files is 10,000 PutObject calls, and botocore spends about
3 ms of client CPU on each (parameter serialisation, endpoint rules, a dozen events, response
parsing by the model), three times what ``s5cmd`` spends; with the sealer's requests in flight on
a box whose cores the training job and the store share, that CPU is the limit, not the network.

What stays botocore's, so that a lean PUT means on the wire what boto3's does: the SigV4
signature (``botocore.auth.S3SigV4Auth``, the client's own config, so the same unsigned
payload and signed headers; on wire.py's transport sigv4.py signs it, byte for byte as
botocore would), the credentials (the session's, refreshed as boto3 refreshes them),
the region, and the parsing of an error answer (the client's rest-xml parser, raised as the
``ClientError`` boto3 would raise, so errors.py maps it the same). The transport is wire.py's
where it applies (the client's endpoint, CA bundle and timeouts; no proxy): one send per PUT
and a GET's body received straight into the caller's buffer; else the client's own
``URLLib3Session`` (PUTs only: without wire.py a download stays on boto3). The ``before-send``
and ``after-call`` events of PutObject are emitted as botocore emits them, so whatever hooks
the client (a test's damaged body or lying answer) sees lean PUTs too; lean HEADs and GETs
emit none.

What is not taken here: conditional puts (``If-None-Match``/``If-Match``, a few per seal, with
their NotImplemented fallback) and multipart uploads (whose parts are large: the per-request CPU
does not matter) stay on boto3, and so does every request to AWS itself, whose virtual-hosted
addressing, S3 Express and region redirects the lean PUT does not do; it is proven here against
SeaweedFS only (path-style addressing, any S3-compatible endpoint).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Tuple
from urllib.parse import urlsplit

import botocore.exceptions as bex
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSPreparedRequest, AWSRequest, HeadersDict
from botocore.parsers import RestXMLParser
from botocore.utils import ensure_boolean, percent_encode

from onbox.sealing.stores.base import with_retries
from onbox.sealing.stores.s3.checksums import SHA256_META, b64
from onbox.sealing.stores.s3.client import is_aws
from onbox.sealing.stores.s3.errors import boto_error, client_error
from onbox.sealing.stores.s3.sigv4 import Signer
from onbox.sealing.stores.s3.wire import Answer, Cut, Wire

if TYPE_CHECKING:
    from onbox.sealing.stores.s3.core import S3Store

# botocore's client tries a request 3 times (client.config); with_retries does the same here,
# briefly, under the caller's own with_retries.
ATTEMPTS = 3


class Lean:
    """Unconditional PutObject of a whole body, and GetObject streamed, for one S3Store; None
    from ``for_store`` where the lean path does not apply (see the module docstring)."""

    def __init__(self, store: S3Store, client: Any, endpoint: str) -> None:
        self.store = store
        self.client = client
        self.path = f"/{percent_encode(store.bucket, safe='~')}/"
        self.base = endpoint.rstrip("/") + self.path
        self.region = client.meta.region_name or "us-east-1"
        self.signer = Signer(self.region)
        self.model = client.meta.service_model.operation_model("PutObject")
        self.get_model = client.meta.service_model.operation_model("GetObject")
        self.head_model = client.meta.service_model.operation_model("HeadObject")
        self.http = client._endpoint.http_session
        self.wire = Wire.for_client(client)
        self.events = client.meta.events
        self.parser = RestXMLParser()

    @classmethod
    def for_store(cls, store: S3Store, client: Any, session: Any) -> Optional[Lean]:
        endpoint = str(client.meta.endpoint_url)
        parts = urlsplit(endpoint)
        if (
            parts.scheme not in ("http", "https")
            or parts.path not in ("", "/")
            or parts.query
            or is_aws(endpoint)
            or client.meta.config.s3.get("addressing_style") != "path"
            # Client-side monitoring reads a context of botocore's own from after-call.
            or _csm_enabled(session)
            or getattr(getattr(client, "_endpoint", None), "http_session", None) is None
        ):
            return None
        return cls(store, client, endpoint)

    def put(self, full: str, headers: Mapping[str, str], data: bytes, doing: str) -> Any:
        """PUT ``data`` under the full key ``full`` with ``headers``; the answer as boto3's
        ``put_object`` gives it (``ETag``, ``ChecksumCRC32`` where the store echoed one)."""
        once = functools.partial(self._once, full, headers, data, doing)
        return with_retries(once, attempts=ATTEMPTS, base=0.2, cap=1.0)

    def _once(self, full: str, headers: Mapping[str, str], data: bytes, doing: str) -> Any:
        try:
            return self._send(full, headers, data)
        except bex.ClientError as e:
            raise client_error(self.store, e, doing) from None
        except bex.BotoCoreError as e:
            raise boto_error(self.store, e, doing) from None

    def _signed(self, method: str, full: str, headers: Mapping[str, str], data: bytes) -> Any:
        """The request for ``full``, signed as the client signs it (a prepared request)."""
        if self.wire is not None:
            url, signed = self._signed_here(method, full, headers)
            # Plain headers: a before-send hook sees (and may change) the body and headers as
            # sent; a case-insensitive dict of them would cost more than the rest of the PUT.
            return AWSPreparedRequest(method, url, signed, data, False)
        url = self.base + percent_encode(full, safe="/~")
        request = AWSRequest(method=method, url=url, data=data, headers=dict(headers))
        request.context["client_config"] = self.client.meta.config  # payload signing as boto's
        creds = self.store.credentials()
        if creds is None:
            raise bex.NoCredentialsError()
        S3SigV4Auth(creds.get_frozen_credentials(), "s3", self.region).add_auth(request)
        return request.prepare()

    def _signed_here(
        self, method: str, full: str, headers: Mapping[str, str]
    ) -> Tuple[str, Dict[str, str]]:
        """(URL, headers with Host and the signature) for ``full``, signed by sigv4.py."""
        assert self.wire is not None
        key = percent_encode(full, safe="/~")
        creds = self.store.credentials()
        if creds is None:
            raise bex.NoCredentialsError()
        host = self.wire.host_header
        signed = self.signer.sign(
            method, host, self.path + key, headers, creds.get_frozen_credentials()
        )
        signed["Host"] = host
        return self.base + key, signed

    def _sent(self, prepared: Any) -> Any:
        """``prepared`` sent on the wire where there is one (its answer read whole: status_code,
        headers by lower-case name, content), else on the client's own transport."""
        if self.wire is None:
            return self.http.send(prepared)
        with self.wire.request(
            prepared.method, prepared.url, prepared.headers, prepared.body
        ) as answer:
            return _Answered(answer.status, answer.plain_headers(), answer.read())

    def open_get(self, full: str, headers: Mapping[str, str], cut: Optional[Cut] = None) -> Answer:
        """GET ``full`` with ``headers`` (Range, If-Match) on the wire: the answer, whose body
        the caller reads into its own buffer and then closes; ``cut`` ends it from another
        thread (wire.Cut). A refusal (any status but 200 and 206) is raised as the ClientError
        boto3 would raise; only where ``wire`` is not None."""
        assert self.wire is not None
        url, signed = self._signed_here("GET", full, headers)
        answer = self.wire.request("GET", url, signed, cut=cut)
        if answer.status in (200, 206):
            return answer
        with answer:
            body = answer.read() if answer.status != 304 else b""
        parsed = self.parser.parse(
            {"status_code": answer.status, "headers": answer.headers, "body": body},
            self.get_model.output_shape,
        )
        raise bex.ClientError(parsed, "GetObject")

    def head(self, full: str, cut: Optional[Cut] = None) -> Optional[Dict[str, Any]]:
        """HEAD ``full`` on the wire: what a download needs of boto3's ``head_object`` answer
        (``ContentLength``, ``ETag``), None for a missing key (a bare 404, as boto3 tells it);
        ``cut`` ends it from another thread. Any other refusal is raised as the ClientError
        boto3 would raise; only where ``wire`` is not None."""
        assert self.wire is not None
        url, signed = self._signed_here("HEAD", full, {})
        with self.wire.request("HEAD", url, signed, cut=cut) as answer:
            status, got = answer.status, answer.plain_headers()
        if status == 404:
            return None
        length = got.get("content-length", "").strip()
        if status == 200 and length.isdigit():
            return {"ContentLength": int(length), "ETag": got.get("etag")}
        if status == 200:  # boto3 would hand on a HEAD without a size: refused here instead
            error = {"Code": "BadAnswer", "Message": f"HEAD without a size ({length!r})"}
            raise bex.ClientError({"Error": error, "ResponseMetadata": {}}, "HeadObject")
        parsed = self.parser.parse(
            {"status_code": status, "headers": HeadersDict(got), "body": b""},
            self.head_model.output_shape,
        )
        raise bex.ClientError(parsed, "HeadObject")

    def _send(self, full: str, headers: Mapping[str, str], data: bytes) -> Dict[str, Any]:
        prepared = self._signed("PUT", full, headers, data)
        hooked = [r for _, r in self.events.emit("before-send.s3.PutObject", request=prepared)]
        answer = next((r for r in hooked if r is not None), None)
        response = answer if answer is not None else self._sent(prepared)
        status = int(response.status_code)
        got = response.headers  # case-insensitive, or (the wire's) by lower-case name
        if status >= 300:
            parsed = self.parser.parse(
                {"status_code": status, "headers": HeadersDict(got), "body": response.content},
                self.model.output_shape,
            )
            raise bex.ClientError(parsed, "PutObject")
        out: Dict[str, Any] = {
            "ResponseMetadata": {"HTTPStatusCode": status, "HTTPHeaders": dict(got)}
        }
        if got.get("etag") is not None:
            out["ETag"] = got["etag"]
        if got.get("x-amz-checksum-crc32") is not None:
            out["ChecksumCRC32"] = got["x-amz-checksum-crc32"]
        self.events.emit(
            "after-call.s3.PutObject",
            http_response=response,
            parsed=out,
            model=self.model,
            context={},
        )
        return out


class _Answered:
    """A wire answer read whole, with what AWSResponse offers a PUT's caller and its events:
    ``status_code``, ``headers`` (by lower-case name), ``content``."""

    def __init__(self, status: int, headers: Dict[str, str], content: bytes) -> None:
        self.status_code = status
        self.headers = headers
        self.content = content


def lean_headers(crc: bool, sent: bytes, sha256: str) -> Dict[str, str]:
    """The headers boto3 makes of put_object's ContentType, Metadata and checksum arguments."""
    return {
        "Content-Type": "application/octet-stream",
        f"x-amz-meta-{SHA256_META}": sha256,
        ("x-amz-checksum-crc32" if crc else "Content-MD5"): b64(sent),
    }


def _csm_enabled(session: Any) -> bool:
    """Whether botocore's client-side monitoring is on (AWS_CSM_ENABLED or the profile's
    csm_enabled): boto3's Session keeps botocore's as ``_session``."""
    core = getattr(session, "_session", None)
    if core is None:
        return True  # not known: boto3 it is
    return bool(ensure_boolean(core.get_config_variable("csm_enabled") or False))

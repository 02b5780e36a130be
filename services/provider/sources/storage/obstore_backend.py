"""The :class:`~.objects.ObjectBackend` of ``s3://``, ``gs://`` and ``az://`` datasets, on
``obstore`` (Python bindings of the Rust ``object_store`` crate).

obstore signs requests and finds credentials (environment, web identity, instance metadata; GCS and
Azure likewise); its own retries are off (``max_retries`` 0) because :class:`~.objects.ObjectClient`
retries with the batch's deadline in view. Its errors are turned into :class:`ObjectError` from the
HTTP status and the S3 error code alone: the text the store sent back is never passed on (an S3 error
body can echo the access key id).
"""

from __future__ import annotations

import os
import re
from datetime import timedelta
from urllib.parse import urlsplit

from libbus.errors import DatasetError

from .objects import RETRY_CODES, RETRY_STATUSES, ObjectError, ObjectMeta

__all__ = ["ObstoreBackend"]

STATUS = re.compile(r"status(?: code)?:? (\d{3})")
CODE = re.compile(r"<Code>([A-Za-z]+)</Code>")
AUTH_HELP = {
    "s3": "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN), AWS_PROFILE, or the instance's role",
    "gs": "GOOGLE_APPLICATION_CREDENTIALS or the instance's service account",
    "az": "AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY, "
    "a SAS token or a managed identity",
}
#: The account and key every Azure Storage emulator (Azurite) answers to: public, documented by Microsoft.
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def _obstore():
    try:
        import obstore
        from obstore.store import from_url
    except ImportError as err:
        raise DatasetError("object-store datasets need obstore: pip install 'batchbus[s3]'") from err
    return obstore, from_url


def _endpoint() -> str:
    return (
        os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
        or os.environ.get("AWS_ENDPOINT", "")
    )


class ObstoreBackend:
    """One bucket (container) through obstore; credentials from the environment's standard chain."""

    def __init__(self, scheme: str, bucket: str, timeout_s: float):
        obstore, from_url = _obstore()
        if not bucket:
            raise DatasetError(f"{scheme}://: name a bucket, e.g. {scheme}://my-bucket/path/")
        self.scheme, self.bucket, self.name = scheme, bucket, f"{scheme}://{bucket}"
        self._ob = obstore
        options: dict = {
            "timeout": timedelta(seconds=timeout_s),
            "connect_timeout": timedelta(seconds=min(timeout_s, 10)),
        }
        kwargs: dict = {}
        endpoint, config = {"s3": _s3, "gs": _gcs, "az": _azure}[scheme](bucket)
        if endpoint.startswith("http://"):
            options["allow_http"] = True  # the operator named a plain-HTTP endpoint (an emulator on this host)
        if scheme == "s3":
            kwargs.update(_aws_profile())
        if config:
            kwargs["config"] = config
        default = {"s3": f"{bucket}.s3", "gs": "storage.googleapis.com", "az": "blob.core.windows.net"}[scheme]
        self.host = urlsplit(endpoint).netloc if endpoint else default
        try:
            self.store = from_url(
                f"{scheme}://{bucket}", client_options=options, retry_config={"max_retries": 0}, **kwargs
            )
        except Exception as err:  # noqa: BLE001 - obstore's configuration errors have several types
            raise DatasetError(f"{self.name}: cannot configure the client: {_first_line(err)}") from None

    def _error(self, op: str, what: str, err: BaseException) -> ObjectError:
        text = str(err)
        status = int(m.group(1)) if (m := STATUS.search(text)) else None
        code = m.group(1) if (m := CODE.search(text)) else ""
        where = f"{op} {self.name}/{what}"
        if status in (401, 403):
            return ObjectError(
                f"{where}: refused ({status} {code or 'Forbidden'}): check the provider's credentials for "
                f"{self.name} ({AUTH_HELP[self.scheme]}) and that they may {op} this bucket",
                status,
                code,
            )
        if status == 404:
            return ObjectError(f"{where}: not found (404{' ' + code if code else ''})", status, code)
        if status == 412:
            return ObjectError(f"{where}: the object changed since the dataset was opened (ETag differs)", status, code)
        if status is not None:
            retry = status in RETRY_STATUSES or code in RETRY_CODES
            return ObjectError(f"{where}: HTTP {status} {code}".rstrip(), status, code, retryable=retry)
        # no status: a connection, DNS or timeout error (retryable); its first line names no secret
        return ObjectError(f"{where}: {_first_line(err)}", None, "", retryable=True)

    def list(self, prefix: str) -> list[ObjectMeta]:
        try:
            out = []
            for chunk in self._ob.list(self.store, prefix or None):
                out += [ObjectMeta(o["path"], int(o["size"]), o.get("e_tag") or "") for o in chunk]
            return out
        except Exception as err:  # noqa: BLE001 - obstore raises its own exception types
            raise self._error("LIST", prefix, err) from None

    def head(self, key: str) -> ObjectMeta:
        try:
            o = self._ob.head(self.store, key)
        except Exception as err:  # noqa: BLE001
            raise self._error("HEAD", key, err) from None
        return ObjectMeta(o["path"], int(o["size"]), o.get("e_tag") or "")

    def get_range(self, key: str, start: int, end: int, etag: str) -> memoryview:
        options: dict = {"range": (start, end)}
        if etag:
            options["if_match"] = etag
        try:
            return memoryview(self._ob.get(self.store, key, options=options).bytes())
        except Exception as err:  # noqa: BLE001
            raise self._error("GET", f"{key} (bytes {start}-{end - 1})", err) from None


def _s3(bucket: str) -> tuple[str, dict]:
    """S3: obstore reads the ``AWS_*`` variables itself; the endpoint is read here for plain HTTP."""
    return _endpoint(), {}


def _gcs(bucket: str) -> tuple[str, dict]:
    """GCS: ``STORAGE_EMULATOR_HOST`` (what Google's own client libraries honour) names an emulator,
    spoken to without credentials as those libraries do; else obstore reads ``GOOGLE_*`` itself
    (``GOOGLE_APPLICATION_CREDENTIALS``, ``GOOGLE_SERVICE_ACCOUNT``, ``GOOGLE_BASE_URL``)."""
    host = os.environ.get("STORAGE_EMULATOR_HOST", "").strip().rstrip("/")
    if not host:
        return os.environ.get("GOOGLE_BASE_URL", ""), {}
    url = host if "://" in host else f"http://{host}"
    return url, {"base_url": url, "skip_signature": True}


def _azure(container: str) -> tuple[str, dict]:
    """Azure: ``AZURE_STORAGE_CONNECTION_STRING`` (the Azure SDKs' variable: ``AccountName``,
    ``AccountKey`` or ``SharedAccessSignature``, ``BlobEndpoint`` or ``DefaultEndpointsProtocol`` with
    ``EndpointSuffix``, or ``UseDevelopmentStorage=true`` for a local Azurite) when set; else obstore
    reads ``AZURE_STORAGE_*`` itself (account and key, SAS, ``AZURE_STORAGE_ENDPOINT``, managed identity)."""
    text = os.environ.get("AZURE_STORAGE_CONNECTION_STRING", "").strip()
    if not text:
        return os.environ.get("AZURE_STORAGE_ENDPOINT", "") or os.environ.get("AZURE_ENDPOINT", ""), {}
    parts = {}
    for item in text.split(";"):
        key, sep, value = item.strip().partition("=")
        if sep:
            parts[key.strip().lower()] = value.strip()
    if parts.get("usedevelopmentstorage", "").lower() == "true":
        proxy = parts.get("developmentstorageproxyuri", "http://127.0.0.1").rstrip("/")
        parts = {
            "accountname": AZURITE_ACCOUNT,
            "accountkey": AZURITE_KEY,
            "blobendpoint": f"{proxy}:10000/{AZURITE_ACCOUNT}",
        }
    account = parts.get("accountname", "")
    if not account:
        raise DatasetError(
            f"az://{container}: AZURE_STORAGE_CONNECTION_STRING names no AccountName (expected "
            "AccountName=...;AccountKey=...;BlobEndpoint=... or UseDevelopmentStorage=true)"
        )
    endpoint = parts.get("blobendpoint", "").rstrip("/")
    if not endpoint:
        proto = parts.get("defaultendpointsprotocol", "https")
        endpoint = f"{proto}://{account}.blob.{parts.get('endpointsuffix', 'core.windows.net')}"
    config = {"account_name": account, "endpoint": endpoint}
    if parts.get("accountkey"):
        config["account_key"] = parts["accountkey"]
    elif parts.get("sharedaccesssignature"):
        config["sas_key"] = parts["sharedaccesssignature"]
    return endpoint, config


def _aws_profile() -> dict:
    """Credentials from a profile (``AWS_PROFILE``, ``~/.aws/credentials``) through boto3, when the
    environment gives no keys and boto3 is installed; object_store reads keys, web identity and
    instance metadata itself."""
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        return {}
    has_profile = os.environ.get("AWS_PROFILE") or os.path.exists(
        os.environ.get("AWS_SHARED_CREDENTIALS_FILE", os.path.expanduser("~/.aws/credentials"))
    )
    if not has_profile:
        return {}
    try:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        return {}
    session = boto3.Session()
    return {"credential_provider": Boto3CredentialProvider(session), "region": session.region_name or "us-east-1"}


def _first_line(err: BaseException) -> str:
    line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return line[:300]

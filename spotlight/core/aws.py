"""AWS clients' logs without credentials: botocore's DEBUG request dumps carry the access key id
and session token, so every client we make (the S3 store, the EC2 price history) filters them."""

from __future__ import annotations

import logging
import re

# The access key id follows "Credential=" in an Authorization header (and in presigned URLs); the
# session token is a header value, "'X-Amz-Security-Token': b'...'" in botocore's request repr and
# "x-amz-security-token:..." in its canonical request. The secret key itself is never sent.
_CREDENTIAL_RE = re.compile(
    r"(Credential=)[^/\s,;&'\"%]+|(x-amz-security-token['\"]?\s*[:=]\s*b?['\"]?)[^'\"\s,;&}]+",
    re.IGNORECASE,
)


def redact(text: str) -> str:
    """`text` with AWS access key ids and session tokens masked as "***"."""
    return _CREDENTIAL_RE.sub(lambda m: (m.group(1) or m.group(2)) + "***", text)


class _RedactCredentials(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is the handler's business, not ours
            return True
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True


_REDACT_FILTER = _RedactCredentials()
# Logger filters do not apply to records of child loggers, so each logger gets the filter.
_LOGGERS_THAT_PRINT_HEADERS = (
    "botocore.endpoint",
    "botocore.auth",
    "botocore.awsrequest",
    "botocore.httpsession",
    "botocore.hooks",
    "botocore.parsers",
    "botocore.retryhandler",
    "urllib3.connectionpool",
)


def install_log_redaction() -> None:
    """Mask credentials in the records of boto3's, botocore's, s3transfer's and urllib3's loggers."""
    names = set(_LOGGERS_THAT_PRINT_HEADERS)
    names.update(
        n for n in logging.root.manager.loggerDict if n.split(".")[0] in ("botocore", "boto3", "s3transfer", "urllib3")
    )
    for name in names:
        log = logging.getLogger(name)
        if _REDACT_FILTER not in log.filters:
            log.addFilter(_REDACT_FILTER)

"""The session's moto S3 server and the fault matrix the fault tests fill in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class S3Server:
    endpoint_url: str
    storage_options: dict[str, Any]

    def bucket(self, name: str) -> str:
        """Create bucket `name` and return its s3:// URI."""
        import boto3

        client = boto3.client(
            "s3", endpoint_url=self.endpoint_url, region_name="us-east-1",
            aws_access_key_id="testing", aws_secret_access_key="testing",
        )
        client.create_bucket(Bucket=name)
        return f"s3://{name}"


# -- the fault matrix ----------------------------------------------------------------------
# Fault tests record what happened (`fault_matrix.add(...)`); the session ends with the table:
# fault -> when it was detected -> outcome -> samples identical to an uninterrupted run.
class FaultMatrix:
    """What the fault tests record (`fault_matrix.add(...)`): fault -> when it was detected ->
    outcome -> samples identical to an uninterrupted run. A row travels in its test's report
    (`user_properties`), so the session's table is whole under pytest-xdist too."""

    COLUMNS = ("fault", "detected", "outcome", "samples identical")
    KEY = "fault-matrix row"

    def __init__(self, properties: list[tuple[str, object]]) -> None:
        self.properties = properties

    def add(self, fault: str, detected: str, outcome: str, identical: bool | None) -> None:
        same = "n/a" if identical is None else ("yes" if identical else "NO")
        self.properties.append((self.KEY, (fault, detected, outcome, same)))

    @classmethod
    def table(cls, rows: list[tuple[str, ...]]) -> str:
        lines = ["| " + " | ".join(cls.COLUMNS) + " |", "|" + "---|" * len(cls.COLUMNS)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)

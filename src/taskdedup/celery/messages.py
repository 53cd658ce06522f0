"""What taskdedup adds to a Celery message: the key header and kept arguments."""

from __future__ import annotations

import base64
import json
from typing import Any

from kombu import serialization

KEY_HEADER = "taskdedup_key"


def dump_call(args: Any, kwargs: Any, serializer: str) -> str:
    """The arguments of a duplicate, kept for reschedule_once in the task's own serializer."""
    content_type, encoding, data = serialization.dumps(  # type: ignore[no-untyped-call]
        (args, kwargs), serializer=serializer
    )
    raw = data if isinstance(data, bytes) else data.encode(encoding or "utf-8")
    return json.dumps([content_type, encoding, base64.b64encode(raw).decode()])


def load_call(payload: str) -> tuple[Any, Any]:
    content_type, encoding, data = json.loads(payload)
    body = serialization.loads(  # type: ignore[no-untyped-call]
        base64.b64decode(data), content_type, encoding, accept=[content_type]
    )
    return body[0], body[1]

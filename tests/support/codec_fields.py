"""What the codec tests share: request fields as Redis returns them, the default limits, and
any JSON value (a hypothesis strategy), for test_codec.py and test_codec_malformed.py."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from batchline.codec import Limits

LIMITS = Limits()
#: Keys that start with "$" (a JSON schema's among them), which travel with one more "$".
DOLLAR_KEYS = ["$defs", "$ref", "$nd", "$", "$$", "$$nd", "$id"]


def as_redis(fields: dict[str, Any]) -> dict[bytes, bytes]:
    """Fields as Redis stores and returns them (what redis-py's encoder sends)."""
    out = {}
    for k, v in fields.items():
        if isinstance(v, bytes):
            out[k.encode()] = v
        elif isinstance(v, float):
            out[k.encode()] = repr(v).encode()
        else:
            out[k.encode()] = str(v).encode()
    return out


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(max_size=6) | st.sampled_from(DOLLAR_KEYS), children)
    ),
    max_leaves=20,
)

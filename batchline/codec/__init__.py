"""Wire codec: requests as stream fields, results as msgpack field lists, values as JSON
plus raw bytes.

A *value* (a request's input, a result's output) travels as two fields: ``meta``, UTF-8 JSON
in which every array is replaced by ``{"$nd": [dtype, shape, offset]}``, and ``blob``, the
arrays' bytes one after the other (C order). Strings, numbers, booleans, null, lists and
dicts with string keys travel as JSON (a key that starts with ``$`` with one ``$`` more in
front), nested at most ``MAX_JSON_DEPTH`` (64) deep, a depth read in the bytes before they
are parsed. Nothing is ever unpickled or evaluated: decoding is
``json.loads`` plus ``numpy.frombuffer`` over bytes already received, after checking the
dtype against a whitelist of plain numeric types and the shape against both the bytes
present and ``max_elements``, so a hostile header can never make the reader allocate.

Request fields: ``v`` (schema version), ``id``, ``meta``, ``blob``, ``prio``, ``dl`` (deadline,
unix ms), ``ts`` (enqueued, unix ms), ``reply`` (producer id), ``stream`` (1: push generated
tokens as chunks, ``_chunks``), ``traceparent`` and ``tracestate`` (optional W3C trace
context). Result fields: ``v``, ``id``,
``status`` (ok | error | expired | cancelled), ``meta``/``blob`` (the output), ``etype``,
``emsg``, ``queue_ms``, ``batch``, ``model_ms``, ``worker``, as one msgpack array of field,
value, field, value, ... (the result key's value; a reply entry carries an array of them).
See ``docs/protocol.md``.

The package's parts: ``_values`` (values and their limits; embeddings scaled to unit
length), ``_requests`` (request fields, validated by pydantic), ``_results`` (result field
lists, checked by hand), ``_chunks`` (the chunk entries of streamed generations, checked by
hand). What this package
exports is the Python form of the contract; the worker's and the producer's own helpers
(decoding a whole read, salvaging a malformed entry's id, the hot-path result encoder) stay
in those modules.
"""

from batchline.codec._requests import (
    MAX_COST,
    Request,
    decode_request,
    encode_request,
    request_cost,
    request_tenant,
    request_value,
)
from batchline.codec._results import (
    Result,
    decode_result,
    encode_result,
    pack_result,
    unpack_result,
)
from batchline.codec._values import (
    MAX_JSON_DEPTH,
    SCHEMA_VERSION,
    Limits,
    non_finite,
    pack_value,
    unit_rows,
    unpack_value,
)
from batchline.errors import DecodeError

__all__ = [
    "MAX_COST",
    "MAX_JSON_DEPTH",
    "SCHEMA_VERSION",
    "DecodeError",
    "Limits",
    "Request",
    "Result",
    "decode_request",
    "decode_result",
    "encode_request",
    "encode_result",
    "non_finite",
    "pack_result",
    "pack_value",
    "request_cost",
    "request_tenant",
    "request_value",
    "unit_rows",
    "unpack_result",
    "unpack_value",
]

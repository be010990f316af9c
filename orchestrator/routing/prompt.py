"""The prompt of a request, for routing on it: cheap, best effort, never an error.

Prefix-affinity routing needs the leading text of the prompt, nothing else, so
these readers look for `text_input` (the TRT-LLM ensemble's and BLS model's
prompt tensor) and return None for anything they do not understand; the request
is then routed on load alone and forwarded unchanged.

- HTTP `generate` / `generate_stream`: a JSON object with `text_input`.
- HTTP `infer` (KServe v2 JSON): `inputs[{name: text_input, data: [...]}]`.
- gRPC ModelInfer / ModelStreamInfer: the serialized ModelInferRequest, read with a
  minimal protobuf wire-format walk (no generated classes needed): the
  `text_input` tensor's bytes from `raw_input_contents` (field 7, index-aligned
  with `inputs`, field 3) or from its `contents.bytes_contents`.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

# Only the head of a prompt matters for a prefix; cap the work on huge prompts.
MAX_PROMPT_CHARS = 16384
PROMPT_TENSOR = "text_input"


# json.loads(bytes) first guesses the encoding (a UTF-16 or -32 document has a NUL in its first
# four bytes); a UTF-8 one, as every generation's body is, then decodes as here. Skipping the
# guess: 4.2 -> 2.6 us for a short body on the 2-core box, on the path of every request.
_decode = json.JSONDecoder().decode


def _parsed(body: bytes) -> Any:
    """The document as json.loads reads it. orjson first: a 2 KB prompt's body in 1.9 us against
    the json module's 6.1 (0.8 against 3.8 for a short one), on the 2-core box; it reads strictly
    less (no NaN, no lone surrogate, no UTF-16, no integer past 64 bits), and what it refuses is
    read by the json module, as before."""
    if b"\0" in body[:4]:
        return json.loads(body)
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return _decode(body.decode("utf-8", "surrogatepass"))


def prompt_of_json(body: bytes) -> str | None:
    if not body or body[:1] not in (b"{", b" ", b"\n", b"\t", b"\r"):
        return None
    try:
        doc = _parsed(body)
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nested past json's depth
        return None
    if not isinstance(doc, dict):
        return None
    text = doc.get(PROMPT_TENSOR)
    if text is None:
        for tensor in doc.get("inputs") or ():
            if isinstance(tensor, dict) and tensor.get("name") == PROMPT_TENSOR:
                text = tensor.get("data")
                break
    return _first_text(text)


def _first_text(value: Any) -> str | None:
    while isinstance(value, list) and value:
        value = value[0]
    if isinstance(value, str):
        return value[:MAX_PROMPT_CHARS]
    return None


# --- protobuf wire format ---------------------------------------------------------------
def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _fields(buf: bytes):
    """(field number, wire type, value) for each field; value is bytes for length-delimited."""
    value: int | bytes
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 2:
            length, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + length], pos + length
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"wire type {wire}")
        if pos > end:
            raise ValueError("truncated")
        yield number, wire, value


def _first_bytes_element(raw: bytes) -> bytes | None:
    """Triton's BYTES tensor encoding: 4-byte little-endian length, then the bytes."""
    if len(raw) < 4:
        return None
    n = int.from_bytes(raw[:4], "little")
    return raw[4:4 + n]


def prompt_of_grpc(message: bytes) -> str | None:
    try:
        inputs: list[tuple[str, bytes | None]] = []  # (name, first bytes_contents element)
        raw_contents: list[bytes] = []
        for number, wire, value in _fields(message):
            if number == 3 and wire == 2:  # InferInputTensor
                name, inline = "", None
                for n2, w2, v2 in _fields(value):
                    if n2 == 1 and w2 == 2:
                        name = v2.decode(errors="replace")
                    elif n2 == 5 and w2 == 2:  # InferTensorContents
                        for n3, w3, v3 in _fields(v2):
                            if n3 == 8 and w3 == 2:  # bytes_contents
                                inline = v3
                                break
                inputs.append((name, inline))
            elif number == 7 and wire == 2:
                raw_contents.append(value)
        for i, (name, inline) in enumerate(inputs):
            if name != PROMPT_TENSOR:
                continue
            data = inline if inline is not None else (
                _first_bytes_element(raw_contents[i]) if i < len(raw_contents) else None)
            return data[:MAX_PROMPT_CHARS * 4].decode(errors="replace")[:MAX_PROMPT_CHARS] if data else None
    except (ValueError, IndexError):
        return None
    return None

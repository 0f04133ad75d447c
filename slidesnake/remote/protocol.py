"""The Open Inference Protocol (KServe v2) over HTTP, with Triton's binary data extension.

A request is a JSON header followed by the raw bytes of each tensor; the header's length
travels in `Inference-Header-Content-Length`. Tiles as JSON lists would be ~4x larger and
cost more CPU to write than to read them from the slide. Only what slidesnake sends and
receives is covered: one input, one output, the numeric datatypes below.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from slidesnake.errors import RemoteProtocolError, one_line

HEADER_LENGTH = "Inference-Header-Content-Length"

DATATYPES: dict[str, np.dtype] = {
    "UINT8": np.dtype(np.uint8),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
}


@dataclass(frozen=True)
class TensorMetadata:
    """One input or output of a served model; -1 in `shape` is any size."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def describe(self) -> str:
        return f"{self.name} {self.datatype} {list(self.shape)}"


@dataclass(frozen=True)
class ModelMetadata:
    """What `GET /v2/models/{name}` says of a model."""

    name: str
    versions: tuple[str, ...]
    platform: str
    inputs: tuple[TensorMetadata, ...]
    outputs: tuple[TensorMetadata, ...]

    def describe(self) -> str:
        ins = ", ".join(t.describe() for t in self.inputs)
        outs = ", ".join(t.describe() for t in self.outputs)
        return f"inputs [{ins}], outputs [{outs}]"


def parse_metadata(document: dict[str, Any]) -> ModelMetadata:
    """The model metadata response as a ModelMetadata; RemoteProtocolError if malformed."""
    try:
        return ModelMetadata(
            name=document["name"],
            versions=tuple(str(v) for v in document.get("versions", ())),
            platform=document.get("platform", ""),
            inputs=tuple(_tensor(t) for t in document["inputs"]),
            outputs=tuple(_tensor(t) for t in document["outputs"]),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise RemoteProtocolError(f"malformed model metadata ({err!r})") from None


def _tensor(entry: dict[str, Any]) -> TensorMetadata:
    return TensorMetadata(entry["name"], entry["datatype"], tuple(int(d) for d in entry["shape"]))


def encode_request(input_name: str, datatype: str, array: np.ndarray, output_name: str):
    """The body and headers of an inference request for one input tensor, asking for
    `output_name` in binary."""
    array = np.ascontiguousarray(array, dtype=DATATYPES[datatype])
    header = {
        "inputs": [
            {
                "name": input_name,
                "datatype": datatype,
                "shape": list(array.shape),
                "parameters": {"binary_data_size": array.nbytes},
            }
        ],
        "outputs": [{"name": output_name, "parameters": {"binary_data": True}}],
    }
    encoded = json.dumps(header, separators=(",", ":")).encode()
    headers = {
        HEADER_LENGTH: str(len(encoded)),
        "Content-Type": "application/octet-stream",
    }
    return encoded + array.tobytes(), headers


def decode_response(body: bytes, header_length: str | None, output_name: str) -> np.ndarray:
    """The tensor `output_name` of an inference response, binary or JSON, checked for
    what it claims: a header length within the body, a binary size that is exactly the
    shape's, data that is there. RemoteProtocolError (short, quoting nothing long) if not."""
    try:
        split = _header_length(header_length, len(body))
        header = json.loads(body[:split])
        outputs = {o["name"]: o for o in header["outputs"]}
        output = outputs[output_name]
        dtype = DATATYPES[output["datatype"]]
        shape = tuple(int(d) for d in output["shape"])
        count = math.prod(shape)
        if any(d < 0 for d in shape) or count > len(body) + _JSON_VALUES:
            raise ValueError(f"shape {list(shape)} cannot be in a body of {len(body)} bytes")
        if "binary_data_size" not in output.get("parameters", {}):
            return np.asarray(output["data"], dtype=dtype).reshape(shape)
        offset = split
        for entry in header["outputs"]:  # binary outputs follow the header in its order
            if entry is output:
                break
            offset += int(entry.get("parameters", {}).get("binary_data_size", 0))
        size = int(output["parameters"]["binary_data_size"])
        if size != count * dtype.itemsize or offset + size > len(body):
            raise ValueError(
                f"binary_data_size {size} does not hold {list(shape)} {output['datatype']}"
            )
        return np.frombuffer(body, dtype=dtype, count=count, offset=offset).reshape(shape)
    except (KeyError, TypeError, ValueError, IndexError, RecursionError) as err:
        raise RemoteProtocolError(f"malformed inference response ({one_line(err)})") from None


# JSON-encoded outputs: a value takes at least two bytes ("0,"), so a body holds at most
# half its length in values; the slack covers a tiny body.
_JSON_VALUES = 64


def _header_length(value: str | None, body_length: int) -> int:
    if value is None:
        return body_length
    if not value.isdigit() or int(value) > body_length:
        raise ValueError(f"{HEADER_LENGTH} {one_line(value, 40)} is not a length within the body")
    return int(value)

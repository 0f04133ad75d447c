"""The Open Inference Protocol (KServe v2) over HTTP, with Triton's binary data extension.

A request is a JSON header followed by the raw bytes of each tensor; the header's length
travels in `Inference-Header-Content-Length`. Tiles as JSON lists would be ~4x larger and
cost more CPU to write than to read them from the slide. Only what slidesnake sends and
receives is covered: one input, one output, the numeric datatypes below.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from slidesnake.errors import RemoteProtocolError

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
    """The tensor `output_name` of an inference response, binary or JSON."""
    split = int(header_length) if header_length is not None else len(body)
    try:
        header = json.loads(body[:split])
        outputs = {o["name"]: o for o in header["outputs"]}
        output = outputs[output_name]
        dtype = DATATYPES[output["datatype"]]
        shape = tuple(output["shape"])
        if "binary_data_size" not in output.get("parameters", {}):
            return np.asarray(output["data"], dtype=dtype).reshape(shape)
        offset = split
        for entry in header["outputs"]:  # binary outputs follow the header in its order
            if entry is output:
                break
            offset += entry.get("parameters", {}).get("binary_data_size", 0)
        size = output["parameters"]["binary_data_size"]
        data = np.frombuffer(body, dtype=dtype, count=size // dtype.itemsize, offset=offset)
        return data.reshape(shape)
    except (KeyError, TypeError, ValueError) as err:
        raise RemoteProtocolError(f"malformed inference response ({err!r})") from None

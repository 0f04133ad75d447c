"""The remote backend's parts that need no server: the protocol's encoding, the choice of
input layout, the settings. tests/test_remote.py runs them against real servers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from slidesnake.embed.settings import EmbedSettings
from slidesnake.errors import ConfigError, RemoteProtocolError
from slidesnake.models.embedder import build_embedder
from slidesnake.models.input_pixels import normalisation
from slidesnake.models.registry import model_spec
from slidesnake.remote.client import redact
from slidesnake.remote.layout import choose_layout
from slidesnake.remote.protocol import (
    HEADER_LENGTH,
    decode_response,
    encode_request,
    parse_metadata,
)


def metadata(input_type="UINT8", input_shape=(-1, 224, 224, 3), output_shape=(-1, 64)):
    return parse_metadata({
        "name": "m", "versions": ["1"], "platform": "python",
        "inputs": [{"name": "tiles", "datatype": input_type, "shape": list(input_shape)}],
        "outputs": [{"name": "features", "datatype": "FP32", "shape": list(output_shape)}],
    })  # fmt: skip


def test_a_request_is_a_json_header_then_the_raw_tensor():
    tiles = np.arange(2 * 4 * 4 * 3, dtype=np.uint8).reshape(2, 4, 4, 3)
    body, headers = encode_request("tiles", "UINT8", tiles, "features")
    split = int(headers[HEADER_LENGTH])
    header = json.loads(body[:split])
    assert header["inputs"][0] == {
        "name": "tiles", "datatype": "UINT8", "shape": [2, 4, 4, 3],
        "parameters": {"binary_data_size": tiles.nbytes},
    }  # fmt: skip
    assert header["outputs"] == [{"name": "features", "parameters": {"binary_data": True}}]
    assert body[split:] == tiles.tobytes()


def test_a_binary_response_decodes_after_the_outputs_before_it():
    first, second = np.ones((2, 3), np.float16), np.arange(8, dtype=np.float32).reshape(2, 4)
    header = json.dumps({"outputs": [
        {"name": "a", "datatype": "FP16", "shape": [2, 3],
         "parameters": {"binary_data_size": first.nbytes}},
        {"name": "b", "datatype": "FP32", "shape": [2, 4],
         "parameters": {"binary_data_size": second.nbytes}},
    ]}).encode()  # fmt: skip
    body = header + first.tobytes() + second.tobytes()
    np.testing.assert_array_equal(decode_response(body, str(len(header)), "b"), second)
    np.testing.assert_array_equal(decode_response(body, str(len(header)), "a"), first)


def test_a_json_response_decodes_too_and_a_malformed_one_is_a_protocol_error():
    body = json.dumps(
        {"outputs": [{"name": "f", "datatype": "FP32", "shape": [1, 2], "data": [1.5, 2]}]}
    ).encode()
    np.testing.assert_array_equal(decode_response(body, None, "f"), [[1.5, 2.0]])
    with pytest.raises(RemoteProtocolError, match="malformed inference response"):
        decode_response(body, None, "other")
    with pytest.raises(RemoteProtocolError, match="malformed model metadata"):
        parse_metadata({"name": "m"})


def test_layouts_follow_the_served_input():
    spec = model_spec("timm:test_vit")
    uint8 = choose_layout(metadata(), spec, 224, "http://s")
    assert not uint8.normalised and uint8.size == 224 and uint8.dim == 64
    fp16 = choose_layout(metadata("FP16", (-1, 3, 112, 112)), spec, 224, "http://s")
    assert fp16.normalised and fp16.size == 112
    dynamic = choose_layout(metadata("FP32", (-1, 3, -1, -1), (-1, -1)), spec, 256, "http://s")
    assert dynamic.size == 256 and dynamic.dim is None


@pytest.mark.parametrize(
    ("served", "model_name", "message"),
    [
        (metadata("FP32", (-1, 224, 224, 3)), "timm:test_vit", "sends tiles as UINT8"),
        (metadata("UINT8", (8, 224, 224, 3)), "timm:test_vit", "any batch size"),
        (metadata("UINT8", (-1, 112, 112, 3)), "h-optimus-0", "takes 224 px tiles, not 112"),
        (metadata(), "h-optimus-0", "gives 1536-d features, the server 64"),
        (metadata(output_shape=(-1, 4, 4)), "timm:test_vit", "one float vector per tile"),
    ],
)
def test_a_model_slidesnake_cannot_feed_is_refused_with_what_it_offers(served, model_name, message):
    with pytest.raises(ConfigError, match=message) as error:
        choose_layout(served, model_spec(model_name), 224, "http://gpu-1:8000")
    assert "http://gpu-1:8000, model 'm' (inputs [tiles " in str(error.value)


@pytest.mark.parametrize(("tile_px", "grey_levels"), [(224, 0), (448, 0), (256, 1)])
def test_client_preprocessing_is_the_local_backends(tile_px, grey_levels):
    """Tiles a client sends equal what the local embedder feeds its network, so both
    backends give the same features for the same weights: exactly when no resize or a
    whole-number one (a 40x slide for a 20x model), within a grey level otherwise."""
    spec = model_spec("timm:test_vit")
    embedder = build_embedder(spec, "random", None, 224, torch.device("cpu"), "fp32")
    tiles = np.random.default_rng(tile_px).integers(0, 256, (3, tile_px, tile_px, 3), np.uint8)
    tiles[1] = np.linspace(0, 255, tile_px).astype(np.uint8)[:, None, None]  # smooth, too
    local = embedder.preprocess(torch.from_numpy(tiles)).numpy()
    sent = choose_layout(metadata("FP32", (-1, 3, 224, 224)), spec, tile_px, "http://s")
    scale = normalisation(spec)[0]
    difference = np.abs(sent.prepare(tiles, spec) - local) / scale
    assert difference.max() <= grey_levels + 1e-3
    uint8 = choose_layout(metadata(), spec, tile_px, "http://s").prepare(tiles, spec)
    assert uint8.dtype == np.uint8 and uint8.shape == (3, 224, 224, 3)


def test_several_servers_share_a_cohort_and_a_slide_keeps_its_server():
    config = {
        "model": {"name": "timm:test_vit", "backend": "remote"},
        "remote": {"url": ["http://a:8000", "http://b:8000"], "model": "m", "batch_size": 16},
    }
    remote = EmbedSettings.from_config(config).remote
    picks = [remote.server_for(f"slide-{i}") for i in range(200)]
    assert picks == [remote.server_for(f"slide-{i}") for i in range(200)]
    assert 70 < picks.count("http://a:8000") < 130
    assert EmbedSettings.from_config(config).batch_size == 16


def test_credentials_in_a_url_stay_out_of_messages():
    assert redact("https://user:secret@host:8443/v2") == "https://host:8443/v2"
    assert redact("http://host:8000") == "http://host:8000"

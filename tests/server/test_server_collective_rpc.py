"""/collective_rpc over HTTP: the methods of the server's --worker-extension-cls, and nothing else, behind the key."""

from __future__ import annotations

import httpx
from server_helpers import MODEL_NAME, Server

from rlserve.model.loader import iterate_checkpoint
from rlserve.toy import make_model_dir
from rlserve.weight_transfer.checksum import weight_checksums


def test_collective_rpc_calls_only_extension_methods(extension_server: Server, tmp_path) -> None:
    new_dir = make_model_dir(tmp_path / "new", seed=21, initializer_range=0.2)
    body = {"model": MODEL_NAME, "prompt": "rpc", "max_tokens": 6, "temperature": 0.0, "return_token_ids": True}
    with extension_server.client() as http:
        before = http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
        described = http.post("/collective_rpc", json={"method": "describe"})
        assert described.status_code == 200 and described.json() == {
            "results": [{"rank": 0, "local_rank": 0, "device": "cpu"}]
        }
        loaded = http.post(
            "/collective_rpc", json={"method": "load_checkpoint", "args": [str(new_dir / "model.safetensors")]}
        )
        assert loaded.status_code == 200 and loaded.json()["results"][0] > 0
        assert http.post("/reset_prefix_cache").status_code == 200
        after = http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
        assert after != before  # the extension wrote the new checkpoint into the served model

        # The worker's own attributes and unknown names are refused, naming the field; the extension's errors are 400s.
        for method in ("model_runner", "device", "nope", "__init__"):
            refused = http.post("/collective_rpc", json={"method": method})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "method", method
        failed = http.post("/collective_rpc", json={"method": "fail"})
        assert failed.status_code == 400 and "refused" in failed.json()["error"]["message"]
        assert http.post("/collective_rpc", json={"args": []}).status_code == 400
    # No key, no call.
    assert httpx.post(extension_server.url + "/collective_rpc", json={"method": "describe"}).status_code == 401


def test_update_config_and_reload_weights_over_http(extension_server: Server, server_model_dir, tmp_path) -> None:
    """vLLM's own worker methods of the dummy-start flow are callable by name; reload_weights reads the served
    model's directory (putting back its weights whatever was loaded since), or a `weights_path` only under
    --allowed-weight-dirs (none here)."""
    served = weight_checksums(iterate_checkpoint(str(server_model_dir)))
    with extension_server.client() as http:
        to_auto = {"method": "update_config", "args": [{"load_config": {"load_format": "auto"}}]}
        assert http.post("/collective_rpc", json=to_auto).json() == {"results": [None]}
        bad = {"method": "update_config", "args": [{"model_config": {"model": "x"}}]}
        refused = http.post("/collective_rpc", json=bad)
        assert refused.status_code == 400
        assert "model_config.model cannot be updated" in refused.json()["error"]["message"]
        other = make_model_dir(tmp_path / "other", seed=22, initializer_range=0.2)
        load = {"method": "load_checkpoint", "args": [str(other / "model.safetensors")]}
        assert http.post("/collective_rpc", json=load).status_code == 200
        assert http.post("/weight_checker", json={"action": "checksum"}).json()["checksums"] != served
        assert http.post("/collective_rpc", json={"method": "reload_weights"}).json() == {"results": [None]}
        assert http.post("/weight_checker", json={"action": "checksum"}).json()["checksums"] == served
        outside = {"method": "reload_weights", "kwargs": {"weights_path": str(other)}}
        response = http.post("/collective_rpc", json=outside)
        assert response.status_code == 403 and response.json()["error"]["param"] == "weight_dir"
        for bad_call, param in (({"args": [None, "/x"]}, "args"), ({"kwargs": {"weights_iterator": []}}, "kwargs")):
            response = http.post("/collective_rpc", json={"method": "reload_weights", **bad_call})
            assert response.status_code == 400 and response.json()["error"]["param"] == param

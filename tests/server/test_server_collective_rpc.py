"""/collective_rpc over HTTP: the methods of the server's --worker-extension-cls, and nothing else, behind the key."""

from __future__ import annotations

import httpx
from server_helpers import MODEL_NAME, Server

from rlserve.toy import make_model_dir


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

"""SkyRL's calls replayed against `rlserve serve` as a SkyRL user starts it for vLLM: dev mode (VLLM_SERVER_DEV_MODE=1),
no API key anywhere. Its `RemoteInferenceClient` sends no Authorization header on any route; the data plane uses
/tokenize, /detokenize, /v1/chat/completions/render and /inference/v1/generate; the control plane pauses with
mode=keep, sleeps and wakes, resets the prefix cache, reads the world size and pushes weights over its own NCCL
group (gloo here) with vLLM 0.33's init / start / update / finish calls."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file
from server_helpers import Server, free_port

from rlserve.dtypes import dtype_name
from rlserve.toy import make_model_dir
from rlserve.weight_transfer import NCCLTrainerSendWeightsArgs, NCCLWeightTransferEngine

TIMEOUT_S = 60.0
MAX_TOKENS = 12


@pytest.fixture
def skyrl_server(dev_server: Server) -> Server:
    """conftest's dev-mode server, shared with test_framework_releases.py: as SkyRL starts vLLM, no key anywhere."""
    return dev_server


def _generate(http: httpx.Client, token_ids: list[int]) -> dict:
    body = {
        "token_ids": token_ids,
        "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": 1, "ignore_eos": True},
    }
    response = http.post("/inference/v1/generate", json=body, headers={"X-Session-ID": "episode-1"})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_skyrl_data_plane_without_a_key(skyrl_server: Server) -> None:
    with httpx.Client(base_url=skyrl_server.url, timeout=TIMEOUT_S) as http:  # no Authorization header, as SkyRL
        rendered = http.post(
            "/v1/chat/completions/render", json={"messages": [{"role": "user", "content": "2+3="}]}
        ).json()
        token_ids = rendered["token_ids"] if "token_ids" in rendered else rendered["prompt_token_ids"]
        tokenized = http.post("/tokenize", json={"prompt": "2+3="}).json()
        assert tokenized["count"] == len(tokenized["tokens"]) > 0
        text = http.post("/detokenize", json={"tokens": tokenized["tokens"]}).json()["prompt"]
        assert text == "2+3="
        choice = _generate(http, token_ids)
        assert len(choice["token_ids"]) == MAX_TOKENS and choice["finish_reason"] == "length"
        assert len(choice["logprobs"]["content"]) == MAX_TOKENS


def test_skyrl_control_plane_and_weight_sync_without_a_key(skyrl_server: Server, tmp_path: Path) -> None:
    # A checkpoint the shared server has not had (test_framework_releases.py pushes seeds 11 and 12).
    new_dir = make_model_dir(tmp_path / "new", seed=13, initializer_range=0.2)
    new_weights = load_file(new_dir / "model.safetensors")
    names = sorted(new_weights)
    with httpx.Client(base_url=skyrl_server.url, timeout=TIMEOUT_S) as http:
        prompt = http.post("/tokenize", json={"prompt": "weights"}).json()["tokens"]
        before = _generate(http, prompt)["token_ids"]

        assert http.get("/get_world_size").json()["world_size"] == 1
        assert http.post("/pause", params={"mode": "keep", "clear_cache": "false"}).status_code == 200
        assert http.get("/is_paused").json() == {"is_paused": True}
        assert http.post("/resume").status_code == 200
        assert http.post("/sleep", params={"level": 1}).json() == {"status": "sleeping", "level": 1}
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        assert http.post("/wake_up").status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        assert http.post("/reset_prefix_cache").json() == {"success": True}
        assert _generate(http, prompt)["token_ids"] == before  # level 1 kept the weights

        # SkyRL's weight sync: the engine joins the trainer's group while the trainer does (both block until both).
        port = free_port()
        init_info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
        joined: list[httpx.Response] = []
        thread = threading.Thread(
            target=lambda: joined.append(http.post("/init_weight_transfer_engine", json={"init_info": init_info}))
        )
        thread.start()
        group = NCCLWeightTransferEngine.trainer_init({**init_info, "timeout_s": TIMEOUT_S})
        thread.join(TIMEOUT_S)
        assert joined and joined[0].status_code == 200, joined
        try:
            assert http.post("/pause", params={"mode": "keep", "clear_cache": "false"}).status_code == 200
            assert http.post("/start_weight_update").status_code == 200
            update_info = {
                "names": names,
                "dtype_names": [dtype_name(new_weights[n].dtype) for n in names],
                "shapes": [list(new_weights[n].shape) for n in names],
            }
            updated: list[httpx.Response] = []
            thread = threading.Thread(
                target=lambda: updated.append(http.post("/update_weights", json={"update_info": update_info}))
            )
            thread.start()
            args = NCCLTrainerSendWeightsArgs(group=group)
            NCCLWeightTransferEngine.trainer_send_weights(((n, new_weights[n]) for n in names), args)
            thread.join(TIMEOUT_S)
            assert updated and updated[0].status_code == 200, updated
            assert http.post("/finish_weight_update", json={"weight_version": "skyrl-1"}).status_code == 200
            assert http.post("/resume").status_code == 200
        finally:
            group.shutdown()
        after = _generate(http, prompt)
        assert after["token_ids"] != before  # the new random checkpoint answers differently
        assert http.post("/reset_prefix_cache", json={"reset_running_requests": False}).json() == {"success": True}

"""Model names as vLLM takes them: a local directory, or a Hugging Face hub id (`Qwen/Qwen3-0.6B`) resolved through
`huggingface_hub`, which downloads it once into its cache and honours `HF_HUB_OFFLINE`, `HF_HUB_CACHE`/`HF_HOME` and
`HF_TOKEN`."""

from __future__ import annotations

import os

# What the engine reads: config, generation config, tokenizer files and safetensors weights. Not a repository's
# other copies of the weights (.bin, .pt, .gguf, onnx/), which can be many gigabytes.
HUB_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken")


class ModelNotFoundError(ValueError):
    """The model is neither a directory nor a hub id that can be had: its message is one line that names the fix."""


def resolve_model(model: str, revision: str | None = None) -> str:
    """A local model directory for `model`: the directory itself, or the hub id's snapshot in the Hugging Face cache
    (downloaded if missing, at `revision`: a branch, tag or commit; default main)."""
    if os.path.isdir(model):
        return model
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = "" if revision is None else f" at revision {revision}"
    try:
        return snapshot_download(model, revision=revision, allow_patterns=list(HUB_FILES))
    except HFValidationError:
        raise ModelNotFoundError(
            f"model {model}: no such directory (nor a Hugging Face hub id like Qwen/Qwen3-0.6B)"
        ) from None
    except LocalEntryNotFoundError:
        where = f"the Hugging Face cache ({constants.HF_HUB_CACHE})"
        if constants.is_offline_mode():
            why = f"not in {where}, and HF_HUB_OFFLINE=1 forbids downloading it: run `hf download {model}` online"
        else:
            why = f"not in {where}, and the hub could not be reached to download it"
        raise ModelNotFoundError(f"model {model}{at}: no such directory; as a hub id it is {why}") from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(f"model {model}: the hub has no revision {revision}") from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"model {model}: no such directory, and no such model on the hub (or a private or gated one: set HF_TOKEN)"
        ) from None

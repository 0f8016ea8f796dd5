"""`vllm.distributed.weight_transfer.modelexpress_engine` (0.33): the `modelexpress` backend, which ModelExpress
maintains in its own package (`modelexpress_rl`, installed from its repository: PyPI has only a placeholder of that
name) and vLLM re-exports from here, as rlserve does. Its engine is written against vLLM's weight-transfer API, so it
runs on rlserve with the vllm import surface on (`rlserve run`, or RLSERVE_VLLM_SURFACE=1 for `rlserve serve`).

Importing this module without ModelExpress raises ImportError saying how to install it; an import error inside
ModelExpress (one of its own dependencies) is raised as it is."""

_INSTALL = (
    "The 'modelexpress' weight transfer backend requires ModelExpress. Install it with `uv pip install "
    "'git+https://github.com/ai-dynamo/modelexpress@main#subdirectory=modelexpress_client/python'` (PyPI's "
    "modelexpress_rl is a placeholder)."
)
# The modules whose absence means "ModelExpress is not installed", as opposed to a dependency of it missing.
_MODELEXPRESS_MODULES = frozenset(
    {
        "modelexpress",
        "modelexpress_rl",
        "modelexpress_rl.inference",
        "modelexpress_rl.inference.engines",
        "modelexpress_rl.inference.engines.vllm",
        "modelexpress_rl.inference.engines.vllm.weight_transfer_engine",
    }
)
_SURFACE = (
    "The 'modelexpress' weight transfer backend imports vLLM's API: run it with rlserve's vllm import surface "
    "(`rlserve run ...`, or RLSERVE_VLLM_SURFACE=1 in `rlserve serve`'s environment)"
)

try:
    from modelexpress import configure_vllm_logging
    from modelexpress_rl.inference.engines.vllm.weight_transfer_engine import (
        ModelExpressWeightTransferEngine,
        ModelExpressWeightTransferInitInfo,
        ModelExpressWeightTransferUpdateInfo,
    )
except ModuleNotFoundError as exc:
    if exc.name in _MODELEXPRESS_MODULES:
        raise ImportError(_INSTALL) from exc
    if exc.name == "vllm":
        raise ImportError(_SURFACE) from exc
    raise

configure_vllm_logging()

__all__ = [
    "ModelExpressWeightTransferEngine",
    "ModelExpressWeightTransferInitInfo",
    "ModelExpressWeightTransferUpdateInfo",
]

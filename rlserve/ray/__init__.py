"""rlserve on Ray (the optional extra `ray`: pip install 'rlserve[ray]'): engines as Ray actors for a trainer script
(engines.py). The engine's own `data_parallel_backend="ray"` is in rlserve.engine.frontend.ray_launcher."""

from rlserve.engine.frontend.ray_launcher import import_ray

import_ray("rlserve.ray")  # fails here, naming the extra, rather than deep inside the first call

from rlserve.ray.engines import AsyncLLMActor, EngineGroup, RayVLLMWeightSyncClient, create_engines  # noqa: E402

__all__ = ["AsyncLLMActor", "EngineGroup", "RayVLLMWeightSyncClient", "create_engines"]

"""`vllm.distributed.device_communicators` (0.24, 0.33): the communicators extensions build their groups from."""

"""`vllm.distributed.utils` (0.24, 0.33): the stateless group that vLLM's weight-transfer groups are built on."""

from rlserve.weight_transfer.stateless_group import StatelessProcessGroup

__all__ = ["StatelessProcessGroup"]

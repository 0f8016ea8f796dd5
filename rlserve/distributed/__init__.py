"""vLLM 0.33's import paths (`vllm.distributed...`) under rlserve's name: code written for vLLM runs with
`vllm` replaced by `rlserve` in its imports. The implementations live in `rlserve.weight_transfer` and
`rlserve.rl.sync_clients`."""

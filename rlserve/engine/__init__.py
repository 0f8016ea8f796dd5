"""The engine, split by the process each part runs in; imports point one way: frontend -> core -> worker -> sched
-> wire.

- `frontend/`: the caller's process: `LLM`, `AsyncLLM`, output processing, the clients of the core, and what
  starts the core (a process, a Ray actor).
- `core/`: the engine-core process: its main loop, the service that takes the front ends' messages, `EngineCore`
  (the data plane) and its control-plane collaborators (pause, sleep, weights, LoRA, profiling).
- `worker/`: each tensor-parallel rank: the model runner and the followers of rank 0.
- `sched/`: requests, the KV-cache blocks and the scheduler, and the batch a step hands the worker.
- `wire/`: the contract both sides import: the messages, the socket's secret, packed tensors, process helpers.
"""

"""The engine-core process: its main loop, the service of the front ends' messages, `EngineCore` (the data plane)
and the control-plane collaborators it is composed of."""

"""The model library: nn.Modules, layers, attention backends, sampler, weight loader and Triton kernels."""

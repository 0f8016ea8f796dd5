"""Triton kernels (CUDA; CPU-checked under TRITON_INTERPRET=1). Import a kernel module only where it runs: importing
it imports triton, which CPU-only runs never load.

- dot: tl.dot as the kernels use it, on the GPU and under the interpreter
- fused_ops: RMSNorm (with the residual add), Qwen3's q/k RMSNorm + rotary, SiLU-and-mul
- fused_sampling: temperature sampling with the chosen token's logprob in one pass
- paged_attention: KV-cache store, varlen causal attention and split-KV decode over the paged cache
- batch_invariant_matmul: the matmul of batch-invariant mode (its tile chosen by the weight, never by the batch)
- fused_moe: a MoE layer's experts: tokens sorted by expert, grouped gate/up + SiLU and down GEMMs, top-k combine
- fp8_quant: dynamic FP8 activation quantization (per token or 128-group) in the layout torch's scaled_mm takes
"""

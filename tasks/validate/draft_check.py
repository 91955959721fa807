"""Static validation of a draft checkpoint against what vLLM's EAGLE-3 loader takes (no vLLM needed).

Each check is named after the failure it prevents. Several of these make vLLM crash at load or
at the first forward; worse, some load and run while acceptance silently collapses (a missing
`d2t`, wrong auxiliary layers, `norm_before_residual` left to differing defaults). Facts from
vLLM 0.32/0.33 `llama_eagle3.py` and `transformers_utils/configs/speculators/`
(see docs/VALIDATION.md for the list and the errors vLLM gives).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from tasks.common.errors import PermanentError
from tasks.common.verifier import VerifierInfo

VLLM_DRAFT_ARCHITECTURES = ("llama", "qwen3")  # transformer_layer_config.model_type vLLM maps to an EAGLE-3 class
# vLLM's EAGLE-3 draft layers: SiLU MLPs only ("Unsupported activation ... Only silu is supported"), and
# rotary embeddings of these types (model_executor/layers/rotary_embedding get_rope; "mrope" for VL verifiers)
VLLM_DRAFT_ACTIVATIONS = ("silu",)
VLLM_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope", "ntk", "mrope")
EAGLE31_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


@dataclass
class StaticReport:
    draft: str
    checks: list[Check] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def errors(self) -> list[str]:
        return [f"{c.name}: {c.detail}" for c in self.checks if not c.ok]

    def add(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append(Check(name, bool(ok), detail))
        return bool(ok)

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok, "errors": self.errors}


class DraftCheckError(PermanentError, ValueError):
    """The draft would not load in vLLM, or would load and draft wrongly."""


def check_draft(draft: str | Path, verifier: VerifierInfo, expected_aux_layers: list[int] | None = None,
                vllm_flags: dict[str, bool] | None = None) -> StaticReport:
    """Every check runs (the report lists all problems at once); `report.ok` says if all passed."""
    draft = Path(draft)
    report = StaticReport(str(draft))
    config_file, weights_file = draft / "config.json", draft / "model.safetensors"
    if not report.add("files_present", config_file.is_file() and weights_file.is_file(),
                      f"needs config.json and model.safetensors in {draft}"):
        return report
    config = json.loads(config_file.read_text())
    _check_config(report, config, verifier, expected_aux_layers)
    with safe_open(str(weights_file), "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
        d2t = f.get_tensor("d2t") if "d2t" in shapes else None
        t2d = f.get_tensor("t2d") if "t2d" in shapes else None
    _check_weights(report, config, shapes, dtypes, d2t, t2d, verifier)
    for flag in EAGLE31_FLAGS:
        if config.get(flag) and vllm_flags is not None and not vllm_flags.get(flag, False):
            report.warnings.append(f"{flag}=true but the installed vLLM ignores it: the draft will run without "
                                   "the norm it was trained with (acceptance drops)")
    return report


def _check_config(report: StaticReport, config: dict, verifier: VerifierInfo, expected: list[int] | None) -> None:
    report.add("speculators_format", config.get("speculators_model_type") == "eagle3"
               and isinstance(config.get("speculators_config"), dict),
               f"speculators_model_type is {config.get('speculators_model_type')!r}, expected 'eagle3' with a "
               "speculators_config")
    try:
        from speculators.models.eagle3 import Eagle3SpeculatorConfig

        Eagle3SpeculatorConfig.from_dict(config)
        report.add("parses_as_speculators_eagle3_config", True)
    except Exception as e:  # any parse failure is the finding
        report.add("parses_as_speculators_eagle3_config", False, str(e)[:300])
    report.add("no_top_level_model_type", "model_type" not in config,
               f"top-level model_type={config.get('model_type')!r} makes vLLM bypass the speculators loader "
               "('Model architectures ['Eagle3DraftModel'] are not supported')")
    report.add("norm_before_residual_explicit", "norm_before_residual" in config,
               "norm_before_residual missing: vLLM defaults it to True for speculators configs and False for "
               "flat configs; write it explicitly")
    layer_config = config.get("transformer_layer_config") or {}
    report.add("draft_architecture_supported", layer_config.get("model_type") in VLLM_DRAFT_ARCHITECTURES,
               f"transformer_layer_config.model_type={layer_config.get('model_type')!r}; vLLM serves "
               f"{VLLM_DRAFT_ARCHITECTURES}")
    act = layer_config.get("hidden_act")
    report.add("draft_activation_served", act in VLLM_DRAFT_ACTIVATIONS,
               f"transformer_layer_config.hidden_act={act!r}: vLLM's EAGLE-3 draft refuses it ('Unsupported "
               f"activation: {act}. Only silu is supported for now')")
    rope_type = (layer_config.get("rope_parameters") or layer_config.get("rope_scaling") or {}).get("rope_type", "default")
    report.add("draft_rope_served", rope_type in VLLM_ROPE_TYPES,
               f"transformer_layer_config rope_type={rope_type!r}: vLLM's draft layer builds {VLLM_ROPE_TYPES}")
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    ok = isinstance(aux, list) and len(aux) == 3 and all(isinstance(k, int) and 0 <= k <= verifier.num_layers for k in aux)
    report.add("three_aux_layers_in_depth", ok,
               f"eagle_aux_hidden_state_layer_ids={aux}: vLLM's EAGLE-3 fc takes exactly 3 layers, ids within "
               f"0..{verifier.num_layers}")
    if expected is not None:
        report.add("aux_layers_match_training_data", aux == expected,
                   f"config says {aux} but the hidden states were extracted at {expected}: vLLM would feed the "
                   "draft other layers than it was trained on (acceptance collapses silently)")
    verifier_path = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    report.add("verifier_resolvable", bool(verifier_path) and Path(verifier_path).is_dir(),
               f"speculators_config.verifier.name_or_path={verifier_path!r} is not a folder on this machine")
    report.add("hidden_size_matches_verifier", layer_config.get("hidden_size") == verifier.hidden_size
               or config.get("target_hidden_size") == verifier.hidden_size,
               f"draft hidden {layer_config.get('hidden_size')} vs verifier {verifier.hidden_size} without "
               "target_hidden_size")
    report.add("layer_vocab_is_verifier_vocab", layer_config.get("vocab_size") == verifier.vocab_size,
               f"transformer_layer_config.vocab_size={layer_config.get('vocab_size')} vs verifier {verifier.vocab_size}")


def _check_weights(report: StaticReport, config: dict, shapes: dict, dtypes: dict, d2t, t2d,
                   verifier: VerifierInfo) -> None:
    layer_config = config.get("transformer_layer_config") or {}
    hidden = layer_config.get("hidden_size", -1)
    heads, kv_heads = layer_config.get("num_attention_heads", -1), layer_config.get("num_key_value_heads", -1)
    head_dim = layer_config.get("head_dim") or (hidden // heads if heads > 0 else -1)
    target_hidden = config.get("target_hidden_size") or verifier.hidden_size
    draft_vocab = config.get("draft_vocab_size", -1)
    prefixed = sorted(k for k in shapes if k.startswith("model."))
    report.add("no_model_prefix", not prefixed,
               f"{prefixed[:3]}: vLLM adds the prefix itself ('There is no module or parameter named model')")
    expected = {
        "fc.weight": [hidden, 3 * target_hidden],
        "layers.0.self_attn.q_proj.weight": [heads * head_dim, 2 * hidden],
        "layers.0.self_attn.k_proj.weight": [kv_heads * head_dim, 2 * hidden],
        "layers.0.self_attn.v_proj.weight": [kv_heads * head_dim, 2 * hidden],
        "layers.0.hidden_norm.weight": [hidden],
        "norm.weight": [hidden],
        "lm_head.weight": [draft_vocab, hidden],
    }
    for name, shape in expected.items():
        got = shapes.get(name)
        report.add(f"shape:{name}", got == shape,
                   f"{name} is {got}, vLLM expects {shape} (config: hidden {hidden}, heads {heads}/{kv_heads}, "
                   f"draft vocab {draft_vocab}, 3 x target hidden {target_hidden})")
    floats = {k: d for k, d in dtypes.items() if k not in ("d2t", "t2d")}
    report.add("weights_bf16_or_fp16", all(d in ("BF16", "F16") for d in floats.values()),
               f"dtypes {sorted(set(floats.values()))}")
    if draft_vocab != verifier.vocab_size:
        if not report.add("d2t_present", d2t is not None,
                          "d2t missing while the draft vocabulary is smaller than the verifier's: vLLM loads it and "
                          "maps draft id i to target id i, acceptance collapses silently"):
            return
        in_range = d2t.dtype == torch.int64 and d2t.numel() == draft_vocab and bool(
            ((torch.arange(d2t.numel()) + d2t >= 0) & (torch.arange(d2t.numel()) + d2t < verifier.vocab_size)).all())
        report.add("d2t_int64_offsets_in_range", in_range,
                   f"d2t must be int64 [{draft_vocab}] offsets with draft index + d2t in [0, {verifier.vocab_size})")
        if t2d is not None:
            ok = t2d.dtype == torch.bool and t2d.numel() == verifier.vocab_size and int(t2d.sum()) == draft_vocab
            if ok and in_range:
                ok = bool(t2d[torch.arange(d2t.numel()) + d2t].all())
            report.add("t2d_consistent", ok,
                       f"t2d must be bool [{verifier.vocab_size}] selecting exactly the {draft_vocab} ids d2t maps to")

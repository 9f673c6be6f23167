"""A Hugging Face model folder's ``config.json`` -> the keys of a `ModelSpec` (torch-free: the planner uses it).

    titan-plan --model hf:path/to/Llama-3.2-1B          # cost_models.specs.load_model("hf:...")
    titan-run --set model=hf:path/to/Llama-3.2-1B

Supported: ``LlamaForCausalLM`` (model_type ``llama``), the same decoder under
``MistralForCausalLM`` without a sliding window, and ``MixtralForCausalLM`` (its router is the
executor's MoE with ``score_func: softmax, route_norm: true``: softmax over all experts, top-k,
renormalised; SwiGLU experts, no shared expert): GQA (``num_key_value_heads``),
``head_dim``, SwiGLU (``hidden_act: silu``), RMSNorm (``rms_norm_eps``), RoPE
(``rope_theta``; ``rope_scaling`` of rope_type ``default`` or ``llama3``, in the
transformers 4 form ``rope_theta`` + ``rope_scaling`` or the transformers 5 form
``rope_parameters``), ``tie_word_embeddings``, ``max_position_embeddings``.
Everything else -- another architecture (e.g. Qwen2-MoE: its shared expert has a
sigmoid gate the executor's MoE lacks), biases, another activation, another rope type -- is
refused in one line naming the key, its value and what is allowed.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from search_spaces.typed import InputError

PREFIX = "hf:"
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM")
MODEL_TYPES = ("llama", "mistral", "mixtral")
ROPE_TYPES = ("default", "llama3")
# keys the executor's Llama cannot express when set to anything but these values
_MUST_BE = {"attention_bias": (False, None), "mlp_bias": (False, None), "pretraining_tp": (1, None),
            "hidden_act": ("silu", None), "partial_rotary_factor": (1.0, 1, None)}


class HFConfigError(InputError):
    """A Hugging Face model folder or config.json that cannot be used."""


def is_hf_ref(name_or_path: Any) -> bool:
    return isinstance(name_or_path, str) and name_or_path.startswith(PREFIX)


def read_config(folder: str | Path) -> dict:
    """config.json of a model folder, as a dict (one-line errors for a missing folder / file / bad JSON)."""
    d = Path(folder)
    if not d.is_dir():
        raise HFConfigError(f"Hugging Face model folder '{d}' does not exist (give hf:DIR, a folder with "
                            "config.json and model*.safetensors)")
    f = d / "config.json"
    if not f.is_file():
        raise HFConfigError(f"'{d}' has no config.json (a Hugging Face model folder holds config.json and "
                            "model.safetensors or model.safetensors.index.json)")
    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise HFConfigError(f"{f}: not a readable JSON file ({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(cfg, dict):
        raise HFConfigError(f"{f}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def _get(cfg: dict, where: str, key: str, kind=int, default: Any = ...):
    v = cfg.get(key, default)
    if v is ...:
        raise HFConfigError(f"{where}: key '{key}' is missing")
    if v is None and default is None:
        return None
    ok = (isinstance(v, bool) if kind is bool else
          isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) if kind is float else
          isinstance(v, int) and not isinstance(v, bool))
    if not ok:
        raise HFConfigError(f"{where}: key '{key}' must be {'a boolean' if kind is bool else 'a number' if kind is float else 'an integer'}, got {v!r}")
    return float(v) if kind is float else v


def rope_keys(cfg: dict, where: str) -> dict:
    """rope_theta and the llama3 scaling keys of ModelSpec from either config form."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "layer_types" not in cfg:       # transformers >= 5
        scaling, theta = params, params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    else:
        scaling, theta = cfg.get("rope_scaling"), cfg.get("rope_theta", 10000.0)
    out = {"rope_theta": _get({"rope_theta": theta}, where, "rope_theta", float)}
    if scaling is None:
        return out
    if not isinstance(scaling, dict):
        raise HFConfigError(f"{where}: key 'rope_scaling' must be an object or null, got {scaling!r}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise HFConfigError(f"{where}: rope_scaling rope_type '{rope_type}' is not supported "
                            f"(supported: {', '.join(ROPE_TYPES)})")
    if rope_type == "llama3":
        s = f"{where} rope_scaling"
        out.update(rope_scaling="llama3", rope_factor=_get(scaling, s, "factor", float),
                   rope_low_freq_factor=_get(scaling, s, "low_freq_factor", float),
                   rope_high_freq_factor=_get(scaling, s, "high_freq_factor", float),
                   rope_original_max_seq_len=_get(scaling, s, "original_max_position_embeddings", int))
    return out


def model_dict(folder: str | Path) -> dict:
    """The ModelSpec keys (cost_models.specs.ModelSpec) of a Hugging Face model folder."""
    cfg = read_config(folder)
    where = str(Path(folder) / "config.json")
    archs = cfg.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    mtype = cfg.get("model_type")
    if arch not in ARCHITECTURES or mtype not in MODEL_TYPES:
        raise HFConfigError(f"{where}: architecture {arch!r} (model_type {mtype!r}) is not supported "
                            f"(supported: {', '.join(ARCHITECTURES)})")
    for key, allowed in _MUST_BE.items():
        if key in cfg and cfg[key] not in allowed:
            raise HFConfigError(f"{where}: key '{key}' is {cfg[key]!r}; the executor's Llama supports only "
                                f"{allowed[0]!r}")
    if cfg.get("sliding_window") is not None:
        raise HFConfigError(f"{where}: key 'sliding_window' is {cfg['sliding_window']!r}; the executor's "
                            "attention is full causal (null)")
    dim, heads = _get(cfg, where, "hidden_size"), _get(cfg, where, "num_attention_heads")
    d = {"name": Path(folder).resolve().name or "hf-model",
         "dim": dim, "n_layers": _get(cfg, where, "num_hidden_layers"), "n_heads": heads,
         "n_kv_heads": _get(cfg, where, "num_key_value_heads", int, heads) or heads,
         "vocab_size": _get(cfg, where, "vocab_size"), "ffn_hidden": _get(cfg, where, "intermediate_size"),
         "norm_eps": _get(cfg, where, "rms_norm_eps", float, 1e-6),
         "tie_embeddings": _get(cfg, where, "tie_word_embeddings", bool, False),
         "max_seq_len": _get(cfg, where, "max_position_embeddings", int, 2048),
         "mlp": "swiglu", "norm": "rmsnorm", "attention": "gqa",
         "source": f"{PREFIX}{folder}"}
    if mtype == "mixtral":       # executor/models/moe.py: softmax -> top-k -> renormalise, SwiGLU experts
        d.update(n_experts=_get(cfg, where, "num_local_experts"), top_k=_get(cfg, where, "num_experts_per_tok"),
                 moe_ffn_hidden=d["ffn_hidden"], score_func="softmax", route_norm=True, n_dense_layers=0,
                 aux_loss_coef=_get(cfg, where, "router_aux_loss_coef", float, 0.0))
    head_dim = _get(cfg, where, "head_dim", int, None)
    if head_dim:
        d["head_dim"] = head_dim
    d.update(rope_keys(cfg, where))
    return d


def to_hf_config(spec, *, dtype: str = "float32") -> dict:
    """LlamaConfig fields (transformers 4 form, which transformers 5 still reads) of a dense GQA ModelSpec."""
    if spec.attention != "gqa" or spec.mlp != "swiglu" or spec.norm != "rmsnorm" or (spec.is_moe and not mixtral_like(spec)):
        raise HFConfigError(f"model '{spec.name}': Hugging Face export covers Llama models (gqa, swiglu, rmsnorm) "
                            "and Mixtral-style MoE (softmax top-k renormalised, no shared or dense layers) only")
    rope_scaling = None
    if spec.rope_scaling == "llama3":
        rope_scaling = {"rope_type": "llama3", "factor": spec.rope_factor,
                        "low_freq_factor": spec.rope_low_freq_factor,
                        "high_freq_factor": spec.rope_high_freq_factor,
                        "original_max_position_embeddings": spec.rope_original_max_seq_len}
    moe = {}
    if spec.is_moe:
        if spec.moe_ffn_hidden != spec.ffn_hidden:
            raise HFConfigError(f"model '{spec.name}': Mixtral has one FFN width: ffn_hidden ({spec.ffn_hidden}) "
                                f"must equal moe_ffn_hidden ({spec.moe_ffn_hidden})")
        moe = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": spec.n_experts,
               "num_experts_per_tok": spec.top_k, "router_aux_loss_coef": spec.aux_loss_coef,
               "router_jitter_noise": 0.0, "sliding_window": None}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": spec.dim, "intermediate_size": spec.ffn_hidden, "num_hidden_layers": spec.n_layers,
            "num_attention_heads": spec.n_heads, "num_key_value_heads": spec.n_kv_heads, "head_dim": spec.head_dim,
            "vocab_size": spec.vocab_size, "max_position_embeddings": spec.max_seq_len,
            "rms_norm_eps": spec.norm_eps, "rope_theta": spec.rope_theta, "rope_scaling": rope_scaling,
            "tie_word_embeddings": bool(spec.tie_embeddings), "hidden_act": "silu", "attention_bias": False,
            "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02, "pretraining_tp": 1,
            "use_cache": True, "torch_dtype": dtype, **moe}


def mixtral_like(spec) -> bool:
    """An MoE spec whose routing and experts are Mixtral's (what MixtralForCausalLM computes)."""
    return (spec.is_moe and spec.n_shared_experts == 0 and spec.n_dense_layers == 0 and spec.score_func == "softmax"
            and spec.route_norm and spec.route_scale == 1.0 and not spec.load_balance_bias
            and spec.n_expert_groups == 0)

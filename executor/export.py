"""Consolidated safetensors export/import with Hugging Face Llama names.

    titan-run export --checkpoint runs/a/checkpoints/step-000100 --out model.safetensors
    titan-run import --safetensors model.safetensors --model llama3-debug --out ckpt/step-000000

Both run in one process without a process group (DCP ``no_dist``): export
reads the model part of a (sharded, any-layout) checkpoint into full tensors;
import writes a weights-only checkpoint that ``titan-run --resume`` loads into
any layout (fresh optimizer, step 0).  Needs ``pip install safetensors``
(extra ``titan-autoplan[export]``).

Names (ours -> Hugging Face ``LlamaForCausalLM``)::

    tok_embeddings.weight                  model.embed_tokens.weight
    layers.N.attention_norm.weight         model.layers.N.input_layernorm.weight
    layers.N.attention.wq/wk/wv/wo.weight  model.layers.N.self_attn.q_proj/k_proj/v_proj/o_proj.weight
    layers.N.ffn_norm.weight               model.layers.N.post_attention_layernorm.weight
    layers.N.feed_forward.w1/w3/w2.weight  model.layers.N.mlp.gate_proj/up_proj/down_proj.weight
    norm.weight                            model.norm.weight
    output.weight                          lm_head.weight

RoPE: our model rotates interleaved pairs (x[2i], x[2i+1]) (the original Meta
Llama convention); HF's ``rotate_half`` pairs x[i] with x[i + head_dim/2].
Export therefore permutes the rows of q_proj and k_proj within each head
(``w.view(heads, head_dim/2, 2, dim).transpose(1, 2)``, exactly HF's
``convert_llama_weights_to_hf.py``), so the exported file gives HF the same
outputs; import applies the inverse.  Mixture-of-experts models are refused.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from cost_models.specs import load_model

from .checkpoint_files import (FORMAT, MARKER, META, CheckpointError, dcp_load, manifest, model_fingerprint, problem,
                               read_meta)
from .models.llama import Transformer

_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_TOP_INV = {v: k for k, v in _TOP.items()}
_LAYER_INV = {v: k for k, v in _LAYER.items()}


def _rename(name: str, top: dict, layer: dict, src: str, dst: str) -> str | None:
    """`name` through the top-level table, or layer `src`N.key -> `dst`N.layer[key]; None if unknown."""
    if name in top:
        return top[name]
    m = re.match(rf"^{re.escape(src)}(\d+)\.(.+)$", name)
    if not m or m.group(2) not in layer:
        return None
    return f"{dst}{m.group(1)}.{layer[m.group(2)]}"


def hf_name(fqn: str) -> str:
    out = _rename(fqn, _TOP, _LAYER, "layers.", "model.layers.")
    if out is None:
        raise ValueError(f"parameter '{fqn}' has no Hugging Face Llama name (dense Llama models only)")
    return out


def our_name(name: str) -> str:
    out = _rename(name, _TOP_INV, _LAYER_INV, "model.layers.", "layers.")
    if out is None:
        raise ValueError(f"tensor '{name}' is not a Hugging Face Llama parameter name")
    return out


def to_hf_rope(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of q/k_proj: interleaved-pair RoPE order -> HF rotate_half order (per head)."""
    out_dim, dim = w.shape
    return w.view(out_dim // head_dim, head_dim // 2, 2, dim).transpose(1, 2).reshape(out_dim, dim)


def from_hf_rope(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    out_dim, dim = w.shape
    return w.view(out_dim // head_dim, 2, head_dim // 2, dim).transpose(1, 2).reshape(out_dim, dim)


def _needs_rope_permute(fqn: str) -> bool:
    return fqn.endswith(("attention.wq.weight", "attention.wk.weight"))


def _safetensors():
    try:
        # optional package (the export extra): only export/import need it
        import safetensors.torch as st
    except ImportError:
        raise CheckpointError("export/import needs the 'safetensors' package: pip install safetensors "
                              "(or pip install 'titan-autoplan[export]')") from None
    return st


def _plain_shapes(spec) -> dict[str, torch.Size]:
    if spec.is_moe:
        raise CheckpointError(f"model '{spec.name}' is a mixture-of-experts model: safetensors export/import "
                              "covers dense Llama models only")
    if spec.attention != "gqa":
        raise CheckpointError(f"model '{spec.name}' uses {spec.attention} attention: safetensors export/import "
                              "covers Llama (GQA) attention only")
    with torch.device("meta"):
        model = Transformer(spec)
    return {n: p.shape for n, p in model.named_parameters()}


def export_checkpoint(checkpoint: Path, out: Path) -> dict:
    st = _safetensors()
    why = problem(checkpoint)
    if why is not None:
        raise CheckpointError(f"checkpoint {checkpoint} cannot be loaded: {why}")
    meta = read_meta(checkpoint)
    spec = load_model(meta["model"])
    if model_fingerprint(spec) != meta.get("fingerprint"):
        raise CheckpointError(f"checkpoint {checkpoint}: model '{meta['model']}' now has other shapes than when "
                              "it was saved")
    shapes = _plain_shapes(spec)
    state = {"model": {n: torch.empty(s) for n, s in shapes.items()}}
    dcp_load(state, checkpoint, no_dist=True)
    tensors = {}
    for fqn, t in state["model"].items():
        t = to_hf_rope(t, spec.head_dim) if _needs_rope_permute(fqn) else t
        tensors[hf_name(fqn)] = t.contiguous()
    out.parent.mkdir(parents=True, exist_ok=True)
    st.save_file(tensors, str(out), metadata={"format": "pt", "titan_model": str(meta["model"]),
                                              "titan_step": str(meta.get("step", 0)),
                                              "rope": "hf_rotate_half"})
    return {"tensors": len(tensors), "bytes": out.stat().st_size, "step": meta.get("step")}


def import_safetensors(src: Path, model: str, out: Path) -> dict:
    st = _safetensors()
    spec = load_model(model)
    shapes = _plain_shapes(spec)
    loaded = st.load_file(str(src))            # safetensors: no pickle at all
    sd = {}
    for name, t in loaded.items():
        fqn = our_name(name)
        if fqn not in shapes:
            raise CheckpointError(f"{src}: tensor '{name}' ({fqn}) is not a parameter of model '{spec.name}'")
        if tuple(t.shape) != tuple(shapes[fqn]):
            raise CheckpointError(f"{src}: tensor '{name}' has shape {tuple(t.shape)}, model '{spec.name}' "
                                  f"expects {tuple(shapes[fqn])}")
        sd[fqn] = (from_hf_rope(t, spec.head_dim) if _needs_rope_permute(fqn) else t).float().contiguous()
    missing = sorted(set(shapes) - set(sd))
    if missing:
        raise CheckpointError(f"{src}: missing tensor for '{missing[0]}' ({hf_name(missing[0])}) and "
                              f"{len(missing) - 1} more")
    out.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": sd}, checkpoint_id=str(out), no_dist=True)
    meta = {"format": FORMAT, "kind": "weights", "model": model, "model_name": spec.name,
            "fingerprint": model_fingerprint(spec), "step": 0, "time": time.time(), "source": str(src),
            "torch": torch.__version__}
    (out / META).write_text(json.dumps(meta, indent=1))
    (out / MARKER).write_text(json.dumps({"files": manifest(out), "step": 0}))
    return {"tensors": len(sd), "path": str(out)}


def main(argv: list[str]) -> int:
    cmd, rest = argv[0], argv[1:]
    p = argparse.ArgumentParser(prog=f"titan-run {cmd}", description=__doc__.split("\n")[0])
    if cmd == "export":
        p.add_argument("--checkpoint", required=True, help="a complete checkpoint folder (step-N)")
        p.add_argument("--out", required=True, help="the .safetensors file to write")
    else:
        p.add_argument("--safetensors", required=True, help="a Hugging Face Llama-style .safetensors file")
        p.add_argument("--model", required=True, help="model preset name or YAML path it belongs to")
        p.add_argument("--out", required=True, help="checkpoint folder to write (load with titan-run --resume)")
    args = p.parse_args(rest)
    try:
        if cmd == "export":
            info = export_checkpoint(Path(args.checkpoint), Path(args.out))
            print(f"titan-run export: {info['tensors']} tensors ({info['bytes']:,} bytes, step {info['step']}) "
                  f"-> {args.out}")
        else:
            if not Path(args.safetensors).is_file():
                raise CheckpointError(f"'{args.safetensors}' does not exist")
            info = import_safetensors(Path(args.safetensors), args.model, Path(args.out))
            print(f"titan-run import: {info['tensors']} tensors -> {info['path']}")
    except (CheckpointError, ValueError) as e:
        print(f"titan-run: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0

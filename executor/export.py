"""Safetensors export/import with Hugging Face Llama names; Hugging Face model folders both ways.

    titan-run import --hf path/to/Llama-3.2-1B --out init/step-000000      # config.json -> model=hf:DIR
    titan-run export --checkpoint runs/a/checkpoints/step-000100 --hf-dir out/hf [--dtype bf16] [--max-shard-size 5GB]
    titan-run export --checkpoint runs/a/checkpoints/step-000100 --out model.safetensors
    titan-run import --safetensors model.safetensors --model llama3-debug --out ckpt/step-000000

``--hf DIR`` reads the model spec from DIR/config.json (cost_models/hf_config.py) and the
weights from model.safetensors or the shards of model.safetensors.index.json; the
checkpoint names ``hf:<absolute DIR>`` as its model, so ``titan-run --resume`` and
``export`` find the spec again.  ``--hf-dir`` writes what
``transformers.AutoModelForCausalLM.from_pretrained`` loads: config.json (LlamaConfig, with
rope_scaling and tie_word_embeddings) and safetensors shards with their index
(``huggingface_hub.save_torch_state_dict``).  Tied models carry no ``lm_head.weight``
(as Hugging Face saves them).

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
outputs; import applies the inverse.  Mixture-of-experts models: Mixtral-style ones
(``MixtralForCausalLM``: router ``block_sparse_moe.gate``, per-expert ``experts.E.w1/w2/w3``
Linear weights <-> our grouped ``experts.w1/w2/w3``); others are refused.
"""
from __future__ import annotations

import json
import re
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from cost_models import hf_config
from cost_models.specs import load_model
from search_spaces.typed import OneLineArgumentParser

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
    "feed_forward.router.gate.weight": "block_sparse_moe.gate.weight",          # Mixtral
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


# Mixtral experts: ours are grouped [E, dim, hidden] (w1, w3) / [E, hidden, dim] (w2) (models/moe.py
# GroupedExperts); Hugging Face stores one nn.Linear weight per expert, [hidden, dim] / [dim, hidden]
_OUR_EXPERTS = re.compile(r"^layers\.(\d+)\.feed_forward\.experts\.(w[123])$")
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")


def split_experts(fqn: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """Our grouped expert weight -> Hugging Face's per-expert Linear weights ({} if `fqn` is no expert weight)."""
    m = _OUR_EXPERTS.match(fqn)
    if not m:
        return {}
    layer, w = m.groups()
    return {f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight": t[e].T.contiguous()
            for e in range(t.shape[0])}


def merge_experts(loaded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pops Hugging Face's per-expert weights from `loaded` and returns ours, stacked per layer and matrix."""
    groups: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name in [n for n in loaded if _HF_EXPERT.match(n)]:
        layer, e, w = _HF_EXPERT.match(name).groups()
        groups.setdefault((layer, w), {})[int(e)] = loaded.pop(name)
    out = {}
    for (layer, w), by_e in groups.items():
        if sorted(by_e) != list(range(len(by_e))):
            raise CheckpointError(f"layer {layer} {w}: expert weights {sorted(by_e)} are not 0..{len(by_e) - 1}")
        out[f"layers.{layer}.feed_forward.experts.{w}"] = torch.stack([by_e[e].T for e in range(len(by_e))]).float().contiguous()
    return out


def _hf_label(fqn: str) -> str:
    m = _OUR_EXPERTS.match(fqn)
    return (f"model.layers.{m.group(1)}.block_sparse_moe.experts.*.{m.group(2)}.weight" if m else hf_name(fqn))


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


def _hf_hub():
    try:
        # optional package (the export extra): only the Hugging Face folder export needs it
        import huggingface_hub
    except ImportError:
        raise CheckpointError("export --hf-dir needs the 'huggingface_hub' package: pip install huggingface_hub "
                              "(or pip install 'titan-autoplan[export]')") from None
    return huggingface_hub


def _read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    """All tensors of these safetensors files (no pickle at all); a damaged file is one CheckpointError."""
    st = _safetensors()
    out: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"'{f}' does not exist")
        try:
            out.update(st.load_file(str(f)))
        except Exception as e:    # noqa: BLE001 - safetensors' SafetensorError (a plain Exception) for a bad file
            raise CheckpointError(f"{f}: not a readable safetensors file ({str(e).splitlines()[0][:200]})") from None
    return out


def _index_files(index: Path) -> list[Path]:
    """The shard files a ``model.safetensors.index.json`` names (its ``weight_map`` values)."""
    try:
        wm = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(wm.values()))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{index}: not a safetensors index (a JSON object with a 'weight_map'): "
                              f"{type(e).__name__}") from None
    if not all(isinstance(n, str) and "/" not in n and "\\" not in n and n not in ("", ".", "..") for n in names):
        raise CheckpointError(f"{index}: 'weight_map' must map tensor names to file names in the same folder")
    return [index.parent / n for n in names]


def _weight_files(path: Path) -> list[Path]:
    """A .safetensors file, a sharded checkpoint's index.json, or a Hugging Face model folder."""
    if path.is_dir():
        for name in ("model.safetensors.index.json", "model.safetensors"):
            if (path / name).is_file():
                return _weight_files(path / name)
        raise CheckpointError(f"'{path}' holds neither model.safetensors nor model.safetensors.index.json")
    if not path.is_file():
        raise CheckpointError(f"'{path}' does not exist")
    return _index_files(path) if path.name.endswith(".json") else [path]


def _plain_shapes(spec) -> dict[str, torch.Size]:
    if spec.is_moe and not hf_config.mixtral_like(spec):
        raise CheckpointError(f"model '{spec.name}' is a mixture-of-experts model whose routing is not Mixtral's: "
                              "safetensors export/import covers Llama and Mixtral-style models only (softmax "
                              "top-k renormalised, no shared experts, no dense layers, no expert bias or groups)")
    if spec.attention != "gqa":
        raise CheckpointError(f"model '{spec.name}' uses {spec.attention} attention: safetensors export/import "
                              "covers Llama (GQA) attention only")
    with torch.device("meta"):
        model = Transformer(spec)
    return {n: p.shape for n, p in model.named_parameters()}


def _hf_tensors(checkpoint: Path):
    """(spec, meta, {HF name: full fp32 tensor}) of a checkpoint's model (tied: no lm_head.weight, as HF saves it)."""
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
        experts = split_experts(fqn, t)
        if experts:
            tensors.update(experts)
            continue
        t = to_hf_rope(t, spec.head_dim) if _needs_rope_permute(fqn) else t
        tensors[hf_name(fqn)] = t.contiguous()
    return spec, meta, tensors


def export_checkpoint(checkpoint: Path, out: Path) -> dict:
    st = _safetensors()
    spec, meta, tensors = _hf_tensors(checkpoint)
    out.parent.mkdir(parents=True, exist_ok=True)
    st.save_file(tensors, str(out), metadata={"format": "pt", "titan_model": str(meta["model"]),
                                              "titan_step": str(meta.get("step", 0)),
                                              "rope": "hf_rotate_half"})
    return {"tensors": len(tensors), "bytes": out.stat().st_size, "step": meta.get("step")}


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def export_hf_dir(checkpoint: Path, out: Path, *, dtype: str = "fp32", max_shard_size: str = "5GB") -> dict:
    """A folder ``transformers.AutoModelForCausalLM.from_pretrained`` loads: config.json (LlamaConfig) and
    safetensors shards with model.safetensors.index.json (huggingface_hub.save_torch_state_dict)."""
    _safetensors()
    hub = _hf_hub()
    if dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype!r}: allowed: {', '.join(DTYPES)}")
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--hf-dir '{out}' exists and is not a folder")
    spec, meta, tensors = _hf_tensors(checkpoint)
    config = hf_config.to_hf_config(spec, dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype])
    tensors = {k: v.to(DTYPES[dtype]).contiguous() for k, v in tensors.items()}
    try:
        split = hub.split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_size)
    except ValueError as e:
        raise CheckpointError(f"--max-shard-size {max_shard_size!r}: {e} (e.g. 5GB, 500MB)") from None
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("model*.safetensors")) + list(out.glob("model.safetensors.index.json")):
        old.unlink()          # a previous export's shards would be read next to the new ones
    hub.save_torch_state_dict(tensors, out, max_shard_size=max_shard_size,
                              metadata={"format": "pt", "titan_model": str(meta["model"]),
                                        "titan_step": str(meta.get("step", 0))})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"tensors": len(tensors), "shards": len(split.filename_to_tensors), "step": meta.get("step"),
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}


def import_hf_dir(src: Path, out: Path) -> dict:
    """A Hugging Face Llama folder (config.json + model.safetensors or a sharded index) -> a weights checkpoint."""
    if not src.is_dir():
        raise CheckpointError(f"--hf '{src}' is not a folder (a Hugging Face model folder holds config.json and "
                              "model.safetensors or model.safetensors.index.json)")
    ref = f"{hf_config.PREFIX}{src.resolve()}"
    load_model(ref)                                  # config.json first: its one-line errors
    return import_safetensors(_weight_files(src), ref, out, source=str(src))


def import_safetensors(src: Path | list[Path], model: str, out: Path, *, source: str | None = None) -> dict:
    spec = load_model(model)
    shapes = _plain_shapes(spec)
    files = src if isinstance(src, list) else _weight_files(src)
    src = Path(source or files[0])
    loaded = _read_safetensors(files)
    if spec.tie_embeddings:   # a tied checkpoint may carry the head too (a copy of the embedding): not a parameter
        loaded.pop("lm_head.weight", None)
    sd = merge_experts(loaded)
    for fqn, t in sd.items():
        if fqn not in shapes or tuple(t.shape) != tuple(shapes[fqn]):
            raise CheckpointError(f"{src}: expert weights {fqn} have shape {tuple(t.shape)}, model '{spec.name}' "
                                  f"expects {tuple(shapes[fqn]) if fqn in shapes else 'none (not an MoE layer)'}")
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
        raise CheckpointError(f"{src}: missing tensor for '{missing[0]}' ({_hf_label(missing[0])}) and "
                              f"{len(missing) - 1} more")
    n_tensors = len(sd)
    if spec.tie_embeddings:   # the model's state dict names the shared weight twice (get_state_dict keeps both)
        sd["output.weight"] = sd["tok_embeddings.weight"]
    out.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": sd}, checkpoint_id=str(out), no_dist=True)
    meta = {"format": FORMAT, "kind": "weights", "model": model, "model_name": spec.name,
            "fingerprint": model_fingerprint(spec), "step": 0, "time": time.time(), "source": str(src),
            "torch": torch.__version__}
    (out / META).write_text(json.dumps(meta, indent=1))
    (out / MARKER).write_text(json.dumps({"files": manifest(out), "step": 0}))
    return {"tensors": n_tensors, "path": str(out)}


def main(argv: list[str]) -> int:
    cmd, rest = argv[0], argv[1:]
    p = OneLineArgumentParser(prog=f"titan-run {cmd}", description=__doc__.split("\n")[0])
    if cmd == "export":
        p.add_argument("--checkpoint", required=True, help="a complete checkpoint folder (step-N)")
        to = p.add_mutually_exclusive_group(required=True)
        to.add_argument("--out", help="one consolidated .safetensors file to write (fp32, HF Llama names)")
        to.add_argument("--hf-dir", help="a Hugging Face model folder to write: config.json + sharded safetensors "
                                         "with model.safetensors.index.json (AutoModelForCausalLM.from_pretrained)")
        p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="--hf-dir tensor dtype (default fp32)")
        p.add_argument("--max-shard-size", default="5GB", help="--hf-dir largest shard, e.g. 5GB, 500MB (default 5GB)")
    else:
        src = p.add_mutually_exclusive_group(required=True)
        src.add_argument("--hf", metavar="DIR", help="a Hugging Face Llama folder: config.json + model.safetensors "
                                                     "or a sharded model.safetensors.index.json (the model spec "
                                                     "comes from config.json: model=hf:DIR)")
        src.add_argument("--safetensors", help="a Hugging Face Llama-style .safetensors file, or a sharded "
                                               "checkpoint's model.safetensors.index.json (needs --model)")
        p.add_argument("--model", help="with --safetensors: model preset name, YAML path or hf:DIR it belongs to")
        p.add_argument("--out", required=True, help="checkpoint folder to write (load with titan-run --resume)")
    args = p.parse_args(rest)
    if cmd == "import" and args.safetensors and not args.model:
        p.error("--safetensors needs --model (or give --hf DIR, whose config.json is the model)")
    try:
        if cmd == "export" and args.hf_dir:
            info = export_hf_dir(Path(args.checkpoint), Path(args.hf_dir), dtype=args.dtype,
                                 max_shard_size=args.max_shard_size)
            print(f"titan-run export: {info['tensors']} tensors ({info['bytes']:,} bytes {args.dtype}, step "
                  f"{info['step']}) in {info['shards']} shard(s) + config.json -> {args.hf_dir}")
        elif cmd == "export":
            info = export_checkpoint(Path(args.checkpoint), Path(args.out))
            print(f"titan-run export: {info['tensors']} tensors ({info['bytes']:,} bytes, step {info['step']}) "
                  f"-> {args.out}")
        elif args.hf:
            info = import_hf_dir(Path(args.hf), Path(args.out))
            print(f"titan-run import: {info['tensors']} tensors -> {info['path']} "
                  f"(model=hf:{Path(args.hf).resolve()})")
        else:
            if not Path(args.safetensors).exists():
                raise CheckpointError(f"'{args.safetensors}' does not exist")
            info = import_safetensors(Path(args.safetensors), args.model, Path(args.out))
            print(f"titan-run import: {info['tensors']} tensors -> {info['path']}")
    except (CheckpointError, ValueError) as e:
        print(f"titan-run: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0

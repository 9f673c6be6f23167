"""Parameter counts, the matmul inventory of a layer, and the one declared FLOPs formula.

Everything here is a plain function of a `ModelSpec` (no plan, no hardware), so
the executor can use `flops_per_token` for MFU without importing the planner.

Conventions: a matmul ``x[M, K] @ W[K, N]`` costs ``2*M*K*N`` FLOPs forward and
twice that backward (input gradient + weight gradient) -- Kaplan et al. 2020
(arXiv:2001.08361) Sec. 2.1, Narayanan et al. 2021 (arXiv:2104.04473) Sec. 5.1.
"""
from __future__ import annotations

from dataclasses import dataclass

# TP sharding of a matmul: "col" splits N (output features), "row" splits K (input
# features), "none" is replicated on every TP rank (router, MLA down-projections).
COL, ROW, NONE = "col", "row", "none"


@dataclass(frozen=True)
class Matmul:
    """One weight matmul of a layer, as it is issued in forward order."""

    name: str
    k: int                 # input features
    n: int                 # output features
    shard: str             # COL | ROW | NONE (tensor parallel)
    expert: bool = False   # routed expert weight: one copy per expert, tokens*top_k rows in total
    group: str = "attn"    # attn | ffn  (which block it belongs to)

    @property
    def params(self) -> int:
        return self.k * self.n


# --------------------------------------------------------------------------- shapes
def attention_dims(model) -> tuple[int, int, int]:
    """(d_qk, d_k_stored, d_v): query/key width summed over heads, stored K width, value width.

    GQA: queries n_heads*head_dim, keys/values n_kv_heads*head_dim (Ainslie et al. 2023,
    arXiv:2305.13245).  MLA (DeepSeek-V2, arXiv:2405.04434 Sec. 2.1): per head the
    query/key width is qk_nope + qk_rope and the value width v_head_dim; the up-projected
    K and V are materialized per head in training (as TorchTitan does).
    """
    if model.attention == "mla":
        qk = model.n_heads * (model.qk_nope_head_dim + model.qk_rope_head_dim)
        return qk, qk, model.n_heads * model.v_head_dim
    return model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim, model.n_kv_heads * model.head_dim


def attention_matmuls(model) -> list[Matmul]:
    h = model.dim
    if model.attention == "mla":
        qk_head = model.qk_nope_head_dim + model.qk_rope_head_dim
        out: list[Matmul] = []
        if model.q_lora_rank:
            out += [Matmul("wq_a", h, model.q_lora_rank, NONE),
                    Matmul("wq_b", model.q_lora_rank, model.n_heads * qk_head, COL)]
        else:
            out.append(Matmul("wq", h, model.n_heads * qk_head, COL))
        out += [Matmul("wkv_a", h, model.kv_lora_rank + model.qk_rope_head_dim, NONE),
                Matmul("wkv_b", model.kv_lora_rank, model.n_heads * (model.qk_nope_head_dim + model.v_head_dim), COL),
                Matmul("wo", model.n_heads * model.v_head_dim, h, ROW)]
        return out
    q, kv = model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim
    return [Matmul("wq", h, q, COL), Matmul("wk", h, kv, COL), Matmul("wv", h, kv, COL),
            Matmul("wo", q, h, ROW)]


def ffn_matmuls(hidden: int, width: int, mlp: str, *, expert: bool = False, prefix: str = "") -> list[Matmul]:
    """SwiGLU (Shazeer 2020, arXiv:2002.05202): w1 (gate), w3 (up), w2 (down); GELU MLP: fc1, fc2."""
    if mlp == "swiglu":
        return [Matmul(prefix + "w1", hidden, width, COL, expert, "ffn"),
                Matmul(prefix + "w3", hidden, width, COL, expert, "ffn"),
                Matmul(prefix + "w2", width, hidden, ROW, expert, "ffn")]
    return [Matmul(prefix + "fc1", hidden, width, COL, expert, "ffn"),
            Matmul(prefix + "fc2", width, hidden, ROW, expert, "ffn")]


def layer_matmuls(model, moe: bool) -> list[Matmul]:
    """Weight matmuls of one transformer block in forward order (dense or MoE block).

    In an MoE block the routed-expert entries stand for ONE expert's weights; each token
    passes through ``top_k`` of them.  Shared experts (DeepSeek-V3, arXiv:2412.19437
    Sec. 2.1.2) are one dense FFN of width ``n_shared_experts * moe_ffn_hidden``.
    """
    mm = attention_matmuls(model)
    if not moe:
        return mm + ffn_matmuls(model.dim, model.ffn_hidden, model.mlp)
    mm.append(Matmul("router", model.dim, model.n_experts, NONE, False, "ffn"))
    mm += ffn_matmuls(model.dim, model.moe_ffn_hidden, model.mlp, expert=True, prefix="expert.")
    if model.n_shared_experts:
        mm += ffn_matmuls(model.dim, model.n_shared_experts * model.moe_ffn_hidden, model.mlp, prefix="shared.")
    return mm


def norm_params(model) -> int:
    """Per-block norm weights (RMSNorm: weight; LayerNorm: weight + bias), incl. MLA's extra norms."""
    per = model.dim * (2 if model.norm == "layernorm" else 1)
    extra = 0
    if model.attention == "mla":
        extra = model.kv_lora_rank + (model.q_lora_rank or 0)
    return 2 * per + extra


# --------------------------------------------------------------------------- parameter counts
def param_counts(model) -> dict[str, float]:
    """Parameter counts (exact for the architectures of `ModelSpec`; linear biases are not modelled).

    Keys: ``embedding``, ``lm_head`` (0 when tied), ``final_norm``, ``attention`` (one block),
    ``dense_ffn`` (one dense block's FFN), ``expert`` (one routed expert), ``shared_experts``,
    ``router``, ``moe_ffn`` (router + all experts + shared, one block), ``norms`` (one block),
    ``dense_layer``, ``moe_layer``, ``total``, ``active`` (shared + top_k experts per token),
    ``matmul_active`` (the N of the 6N FLOPs formula: active weights that are multiplied,
    LM head included, embedding lookup and norm weights excluded), ``expert_total`` (all
    routed-expert weights in the model).
    """
    h, v = model.dim, model.vocab_size
    attn = sum(m.params for m in attention_matmuls(model))
    norms = norm_params(model)
    dense_ffn = sum(m.params for m in ffn_matmuls(h, model.ffn_hidden, model.mlp))
    emb = v * h
    head = 0 if model.tie_embeddings else v * h
    final_norm = h * (2 if model.norm == "layernorm" else 1)
    out = dict(embedding=float(emb), lm_head=float(head), final_norm=float(final_norm), attention=float(attn),
               dense_ffn=float(dense_ffn), norms=float(norms), expert=0.0, shared_experts=0.0, router=0.0,
               moe_ffn=0.0)
    n_dense, n_moe = model.n_layers - model.n_moe_layers, model.n_moe_layers
    if model.is_moe:
        expert = sum(m.params for m in ffn_matmuls(h, model.moe_ffn_hidden, model.mlp))
        shared = model.n_shared_experts * expert
        router = h * model.n_experts
        out.update(expert=float(expert), shared_experts=float(shared), router=float(router),
                   moe_ffn=float(router + model.n_experts * expert + shared))
    out["dense_layer"] = attn + norms + dense_ffn
    out["moe_layer"] = attn + norms + out["moe_ffn"]
    # a multi-token-prediction module (ModelSpec.mtp_layers): a block of the last layer's kind, the [2h -> h]
    # projection and three norms (two on its inputs, one before the shared head); the head weight is shared
    mtp = model.mtp_layers
    mtp_moe = mtp * (n_moe > 0)
    out["mtp_module"] = float((out["moe_layer"] if n_moe else out["dense_layer"]) + 2 * h * h + 3 * final_norm)
    total = emb + head + final_norm + n_dense * out["dense_layer"] + n_moe * out["moe_layer"] + mtp * out["mtp_module"]
    inactive = (n_moe + mtp_moe) * (model.n_experts - model.top_k) * out["expert"]
    out["total"] = float(total)
    out["active"] = float(total - inactive)
    out["expert_total"] = float((n_moe + mtp_moe) * model.n_experts * out["expert"])
    # matmul weights a token actually multiplies: everything active except lookup and norms;
    # a tied embedding still costs its LM-head matmul, and each MTP module runs the head once more.
    out["matmul_active"] = float(out["active"] - emb - final_norm - model.n_layers * norms + (emb if model.tie_embeddings else 0)
                                 + mtp * (v * h - norms - 3 * final_norm))
    return out


# --------------------------------------------------------------------------- the declared FLOPs formula
def attention_flops_per_token(model, seq_len: int) -> float:
    """Forward+backward FLOPs of causal attention scores and mixing per token, all layers.

    Per layer and token, forward: Q.K^T costs 2*s*d_qk and P.V costs 2*s*d_v over the s
    keys; causal masking halves both (on average a token attends to s/2 keys); backward is
    counted as 2x forward: total 3 * (s/2) * 2 * (d_qk + d_v) = 3 * s * (d_qk + d_v).  For
    d_qk = d_v = d_attn this is 12 * L * d_attn * s / 2 (PaLM, Chowdhery et al. 2022,
    arXiv:2204.02311, Appendix B, with the causal halving).
    """
    d_qk, _, _ = attention_dims(model)
    d_v = model.n_heads * (model.v_head_dim if model.attention == "mla" else model.head_dim)
    return 3.0 * (model.n_layers + model.mtp_layers) * seq_len * (d_qk + d_v)


def flops_per_token(model, seq_len: int) -> float:
    """Model FLOPs per trained token -- THE formula this project uses for MFU.

        flops_per_token = 6 * N_matmul_active + 12 * L * d_attn * seq_len / 2

    * ``N_matmul_active`` = `param_counts`["matmul_active"]: the weights a token is
      multiplied by -- attention projections, dense FFNs, for MoE the router, the shared
      experts and top_k routed experts, and the LM head; NOT the embedding lookup or norm
      weights.  6 = 2 (multiply-add) x 3 (forward + 2x backward), Kaplan et al. 2020.
    * the attention term is PaLM's (arXiv:2204.02311, App. B) 12*L*H*Q*T with causal
      halving (T -> seq_len/2); MLA uses (d_qk + d_v)/2 for d_attn (see
      `attention_flops_per_token`).
    * recomputation (activation checkpointing) is NOT counted: this is model FLOPs, not
      hardware FLOPs.
    """
    return 6.0 * param_counts(model)["matmul_active"] + attention_flops_per_token(model, seq_len)


def megatron_flops_per_token(model, seq_len: int) -> float:
    """Megatron-LM's own model-FLOPs count per token (``num_floating_point_operations`` in
    megatron/training/training.py, after Narayanan et al. 2021 eq. 3): attention scores
    are counted WITHOUT causal halving.  Used only to turn published Megatron TFLOP/s
    figures back into tokens/s."""
    pc = param_counts(model)
    d_qk, _, _ = attention_dims(model)
    return 6.0 * pc["matmul_active"] + 6.0 * (model.n_layers + model.mtp_layers) * seq_len * d_qk * 2

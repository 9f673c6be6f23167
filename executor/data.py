"""Training data: a token stream cut into packed sequences, sharded by dp rank.

* Corpus.  ``"stdlib"`` (the default, works offline) is the Python standard
  library's own source: the sorted ``*.py`` files under
  ``sysconfig.get_paths()["stdlib"]`` (site-packages excluded) up to
  ``max_bytes``.  Otherwise a ``.txt`` file (one document), a ``.jsonl`` file
  (field ``text`` of each line), or a folder of them (sorted).
* Each document becomes ``[BOS] tokens [EOS]``; documents are concatenated
  into one stream, which is cut into samples of ``seq_len + 1`` tokens
  (inputs are the first ``seq_len``, labels the last ``seq_len``).
* Each epoch visits the samples in a permutation seeded by ``(seed, epoch)``.
  Step ``s`` uses the global batch of ``global_batch`` samples at positions
  ``s*global_batch ...`` of that endless order, and dp rank ``r`` (the rank on
  the flattened ``dp`` mesh) takes rows ``r*B/dp ... (r+1)*B/dp`` of it.  CP
  and TP ranks of one dp group therefore see the same batch, and the global
  batch is the same whatever the layout.
* ``state_dict()`` holds the position (the next step), for checkpoints.
"""
from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import torch

from .tokenizer import load_tokenizer


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if rel.parts and rel.parts[0] in ("site-packages", "dist-packages"):
            continue
        files.append(p)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _documents(source: str, max_bytes: int):
    """Yield the corpus documents (bytes or str) in a fixed order, up to `max_bytes` in total."""
    if source == "stdlib":
        paths = stdlib_files()
    else:
        src = Path(source)
        if src.is_dir():
            paths = sorted([p for p in src.rglob("*") if p.suffix in (".txt", ".jsonl")],
                           key=lambda p: p.relative_to(src).as_posix())
            if not paths:
                raise ValueError(f"train key 'data': folder '{src}' has no .txt or .jsonl files")
        elif src.is_file():
            if src.suffix not in (".txt", ".jsonl"):
                raise ValueError(f"train key 'data': '{src}' must be a .txt or .jsonl file")
            paths = [src]
        else:
            raise ValueError(f"train key 'data': '{src}' does not exist")
    total = 0
    for p in paths:
        if p.suffix == ".jsonl":
            with p.open("r", encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        text = json.loads(line)["text"]
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise ValueError(f"{p}:{lineno}: each line must be a JSON object with a 'text' "
                                         "field") from None
                    total += len(text)
                    yield text
                    if total >= max_bytes:
                        return
        else:
            data = p.read_bytes()
            total += len(data)
            yield data
            if total >= max_bytes:
                return


def load_token_stream(source: str, tokenizer, max_bytes: int) -> np.ndarray:
    parts = []
    for doc in _documents(source, max_bytes):
        ids = tokenizer.encode_bytes(doc) if isinstance(doc, bytes) else tokenizer.encode(doc)
        head = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
        tail = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
        parts.append(np.concatenate([np.asarray(head, np.int64), ids, np.asarray(tail, np.int64)]))
    if not parts:
        raise ValueError(f"train key 'data': '{source}' has no text")
    stream = np.concatenate(parts)
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.int32
    return stream.astype(dtype)


class PackedBatches:
    """Deterministic packed batches for one dp rank (see the module docstring)."""

    def __init__(self, stream: np.ndarray, *, seq_len: int, global_batch: int, dp_rank: int, dp_size: int,
                 seed: int):
        if global_batch % dp_size:
            raise ValueError(f"global batch {global_batch} is not divisible by the dp size {dp_size}")
        self.stream, self.seq_len, self.global_batch = stream, seq_len, global_batch
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.n_samples = len(stream) // (seq_len + 1)
        if self.n_samples < global_batch:
            raise ValueError(f"the corpus has {len(stream)} tokens: {self.n_samples} samples of seq_len+1 = "
                             f"{seq_len + 1}, fewer than one global batch ({global_batch})")
        self.step = 0
        self._perm_epoch, self._perm = -1, None

    def _sample_index(self, position: int) -> int:
        epoch, i = divmod(position, self.n_samples)
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_samples)
            self._perm_epoch = epoch
        return int(self._perm[i])

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, labels), each [global_batch / dp, seq_len] int64 on the CPU."""
        local = self.global_batch // self.dp_size
        start = self.step * self.global_batch + self.dp_rank * local
        L = self.seq_len + 1
        rows = np.stack([self.stream[k * L:(k + 1) * L] for k in
                         (self._sample_index(start + j) for j in range(local))]).astype(np.int64)
        self.step += 1
        t = torch.from_numpy(rows)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed, "seq_len": self.seq_len,
                "global_batch": self.global_batch, "n_samples": self.n_samples}

    def load_state_dict(self, sd: dict) -> None:
        for k in ("seed", "seq_len", "global_batch", "n_samples"):
            if k in sd and sd[k] != getattr(self, k):
                raise ValueError(f"data state has {k}={sd[k]}, this run has {getattr(self, k)}")
        self.step = int(sd["step"])


def build_batches(cfg, dp_rank: int, dp_size: int) -> PackedBatches:
    tok = load_tokenizer(cfg.train.tokenizer)
    if tok.vocab_size > cfg.spec.vocab_size:
        raise ValueError(f"tokenizer '{tok.name}' has {tok.vocab_size} tokens, more than the model's "
                         f"vocab_size {cfg.spec.vocab_size}")
    stream = load_token_stream(cfg.train.data, tok, cfg.train.max_corpus_bytes)
    return PackedBatches(stream, seq_len=cfg.seq_len, global_batch=cfg.global_batch, dp_rank=dp_rank,
                         dp_size=dp_size, seed=cfg.train.seed)

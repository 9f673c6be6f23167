"""Training data: a token stream cut into packed sequences, sharded by dp rank.

* Corpus.  ``"stdlib"`` (the default, works offline) is the Python standard
  library's own source: the sorted ``*.py`` files under
  ``sysconfig.get_paths()["stdlib"]`` (site-packages excluded) up to
  ``max_bytes``.  Otherwise a ``.txt`` file (one document), a ``.jsonl`` file
  (field ``text`` of each line), or a folder of them (sorted).  :func:`check_corpus`
  reads it before any process group starts (config validation): another file type,
  a jsonl line that is not a JSON object with a string ``text``, or fewer tokens than
  one global batch is one `DataError` line naming the file.
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

import functools
import json
import os
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from search_spaces.typed import InputError

from .tokenizer import check_tokenizer, quote_path

if TYPE_CHECKING:     # torch only in next_batch: validating a config reads the corpus without it
    import torch


class DataError(InputError):
    """A corpus that cannot be trained on (one line naming the file and the problem; exit code 2)."""


SUFFIXES = (".txt", ".jsonl")
WHAT_IS_READ = "titan-run reads .txt (one document per file) or .jsonl (one JSON object with a 'text' field per line)"


def tokens_needed(seq_len: int, global_batch: int) -> int:
    """Tokens one global batch takes: `global_batch` samples of seq_len + 1 tokens (inputs and shifted labels)."""
    return global_batch * (seq_len + 1)


@functools.lru_cache(maxsize=1)    # a process validates, then trains
def stdlib_files() -> tuple[Path, ...]:
    """The standard library's .py files (not its site-packages), in the order of their relative paths.

    Walked with ``os.walk``, pruning site-packages before descending: ``Path.rglob`` walked the installed
    packages too and took ~0.5 s a process (the launcher and every rank list it), the walk ~0.01 s."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for folder, subdirs, names in os.walk(root):
        if folder == root:
            subdirs[:] = [d for d in subdirs if d not in ("site-packages", "dist-packages")]
        files.extend(Path(folder, n) for n in names if n.endswith(".py"))
    base = Path(root)
    return tuple(sorted((f for f in files if f.is_file()), key=lambda p: p.relative_to(base).as_posix()))


def _corpus_files(source: str) -> tuple[Path, ...]:
    if source == "stdlib":
        return stdlib_files()
    src = Path(source)
    if src.is_dir():
        paths = sorted([p for p in src.rglob("*") if p.suffix in SUFFIXES and p.is_file()],
                       key=lambda p: p.relative_to(src).as_posix())
        if not paths:
            raise DataError(f"train key 'data': folder {quote_path(src)} has no .txt or .jsonl files "
                            f"({WHAT_IS_READ})")
        return tuple(paths)
    if src.is_file():
        if src.suffix not in SUFFIXES:
            kind = f"a {src.suffix} file" if src.suffix else "a file without a .txt/.jsonl suffix"
            raise DataError(f"train key 'data': {quote_path(src)} is {kind}; {WHAT_IS_READ}, or a folder of them")
        return (src,)
    raise DataError(f"train key 'data': {quote_path(src)} does not exist")


def _jsonl_texts(p: Path):
    """The 'text' of each line of a .jsonl file; a line that is not a JSON object with a string 'text' is
    one DataError naming the file and the line."""
    with p.open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"train key 'data': {quote_path(p)} line {lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where} is not JSON ({e.msg} at column {e.colno}); each line must be a JSON "
                                "object with a 'text' field") from None
            if not isinstance(obj, dict) or "text" not in obj:
                got = f"keys {', '.join(map(repr, list(obj)[:5]))}" if isinstance(obj, dict) else type(obj).__name__
                raise DataError(f"{where} has no 'text' field (got {got}); each line must be a JSON object "
                                "with a 'text' field")
            if not isinstance(obj["text"], str):
                raise DataError(f"{where}: 'text' must be a string, got {type(obj['text']).__name__}")
            yield obj["text"]


def _documents(source: str, max_bytes: int):
    """Yield the corpus documents (bytes or str) in a fixed order, up to `max_bytes` in total."""
    total = 0
    for p in _corpus_files(source):
        try:
            docs = _jsonl_texts(p) if p.suffix == ".jsonl" else iter([p.read_bytes()])
            for doc in docs:
                total += len(doc)
                yield doc
                if total >= max_bytes:
                    return
        except UnicodeDecodeError as e:
            raise DataError(f"train key 'data': {quote_path(p)} is not UTF-8 text (byte {e.start}); a .jsonl "
                            "file must be UTF-8") from None
        except OSError as e:
            raise DataError(f"train key 'data': {quote_path(p)} cannot be read: {e.strerror or e}") from None


def _encode(doc, tokenizer) -> np.ndarray:
    """[BOS] tokens [EOS] of one document (the specials the tokenizer has)."""
    ids = tokenizer.encode_bytes(doc) if isinstance(doc, bytes) else tokenizer.encode(doc)
    head = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    tail = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    return np.concatenate([np.asarray(head, np.int64), ids, np.asarray(tail, np.int64)])


def load_token_stream(source: str, tokenizer, max_bytes: int) -> np.ndarray:
    parts = [_encode(doc, tokenizer) for doc in _documents(source, max_bytes)]
    if not parts:
        raise DataError(f"train key 'data': {quote_path(source)} has no text")
    stream = np.concatenate(parts)
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.int32
    return stream.astype(dtype)


def check_corpus(source: str, tokenizer, max_bytes: int, *, seq_len: int, global_batch: int) -> None:
    """Before any process group: read the corpus as training will (the same files, documents and tokenizer)
    until one global batch of tokens is there; every problem is one DataError line naming the file.

    The built-in ``stdlib`` corpus is known text and is not read here: the planner's dry runs name no data
    and plan batches of any size (a real run on it that is too small for the batch stops in `PackedBatches`,
    one line too)."""
    if source == "stdlib":
        return
    need, have = tokens_needed(seq_len, global_batch), 0
    for doc in _documents(source, max_bytes):
        have += len(_encode(doc, tokenizer))
        if have >= need:
            return
    if have == 0:
        raise DataError(f"train key 'data': {quote_path(source)} has no text")
    raise DataError(f"train key 'data': {quote_path(source)} has {have:,} tokens (tokenizer {tokenizer.name}, at most "
                    f"train.max_corpus_bytes = {max_bytes:,} bytes read), fewer than one global batch needs: "
                    f"{global_batch} sequences x (seq_len {seq_len} + 1) = {need:,}; add text, or lower "
                    "workload.global_batch or workload.seq_len")


class PackedBatches:
    """Deterministic packed batches for one dp rank (see the module docstring)."""

    def __init__(self, stream: np.ndarray, *, seq_len: int, global_batch: int, dp_rank: int, dp_size: int,
                 seed: int):
        if global_batch % dp_size:
            raise ValueError(f"global batch {global_batch} is not divisible by the dp size {dp_size}")
        self.stream, self.seq_len, self.global_batch = stream, seq_len, global_batch
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.n_samples = len(stream) // (seq_len + 1)
        if len(stream) < tokens_needed(seq_len, global_batch):
            raise DataError(f"the corpus has {len(stream)} tokens: {self.n_samples} samples of seq_len+1 = "
                            f"{seq_len + 1}, fewer than one global batch ({global_batch}); give more text "
                            "(train.data) or raise train.max_corpus_bytes")
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
        import torch  # torch: launcher path (config validation imports this module to check the corpus)
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
    tok = check_tokenizer(cfg.train.tokenizer, cfg.spec)
    stream = load_token_stream(cfg.train.data, tok, cfg.train.max_corpus_bytes)
    return PackedBatches(stream, seq_len=cfg.seq_len, global_batch=cfg.global_batch, dp_rank=dp_rank,
                         dp_size=dp_size, seed=cfg.train.seed)

"""Tokenizers: a byte-level one that needs nothing, and HF ``tokenizer.json`` files.

The byte tokenizer maps each UTF-8 byte to its value (0..255) and adds three
specials: BOS 256, EOS 257, PAD 258 (vocabulary 259, which fits the 512 of
``llama3-debug``).  A HF ``tokenizer.json`` is read with the ``tokenizers``
package when it is installed.  :func:`check_tokenizer` loads it before any
process group starts (config validation): a missing or unreadable file, or a
vocabulary larger than the model's, is one `TokenizerError` line.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from search_spaces.typed import MAX_SHOWN, InputError


class TokenizerError(InputError):
    """A tokenizer that cannot be used (one line naming the file and the problem; exit code 2)."""


def quote_path(p) -> str:
    """A path for an error line: quoted, cut at the front when very long (its file name stays)."""
    r = repr(str(p)).replace("\n", " ")
    return r if len(r) <= 2 * MAX_SHOWN else "'..." + r[-(2 * MAX_SHOWN - 4):]


class ByteTokenizer:
    name = "bytes"
    vocab_size = 259
    bos_id, eos_id, pad_id = 256, 257, 258

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8).astype(np.int64)

    def encode_bytes(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8).astype(np.int64)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizer.json`` (Hugging Face ``tokenizers``)."""

    def __init__(self, path: str | Path):
        try:
            # optional package (Hugging Face tokenizers): only tokenizer.json files need it
            from tokenizers import Tokenizer
        except ImportError:
            raise TokenizerError(f"train key 'tokenizer': {quote_path(path)} is a tokenizer.json, which needs the "
                                 "'tokenizers' package (pip install tokenizers)") from None
        self.name = str(path)
        self._tok = Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._special(("<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<|endoftext|>"))
        self.eos_id = self._special(("<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|endoftext|>"))
        self.pad_id = self._special(("<pad>", "[PAD]", "<|pad|>"))

    def _special(self, names) -> int | None:
        for n in names:
            i = self._tok.token_to_id(n)
            if i is not None:
                return i
        return None

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_bytes(self, data: bytes) -> np.ndarray:
        return self.encode(data.decode("utf-8", errors="replace"))

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def load_tokenizer(name: str):
    if name == "bytes":
        return ByteTokenizer()
    return HFTokenizer(name)


def check_tokenizer(name: str, spec) -> ByteTokenizer | HFTokenizer:
    """The tokenizer `name` loaded, or one TokenizerError line: no such file, not a tokenizer.json, or more
    tokens than the vocabulary of the model `spec` (both numbers, and the fix)."""
    if name != "bytes":
        try:
            is_file = Path(name).is_file()
        except OSError:             # e.g. a name too long
            is_file = False
        if not is_file:
            raise TokenizerError(f"train key 'tokenizer': file {quote_path(name)} does not exist (or use 'bytes')")
    try:
        tok = load_tokenizer(name)
    except TokenizerError:
        raise
    except Exception as e:  # noqa: BLE001 - the tokenizers package raises its own exception types
        raise TokenizerError(f"train key 'tokenizer': {quote_path(name)} cannot be read as a tokenizer.json: "
                             f"{' '.join(str(e).split())[:200]}") from None
    if tok.vocab_size > spec.vocab_size:
        raise TokenizerError(f"train key 'tokenizer': {quote_path(name)} has {tok.vocab_size} tokens, more than "
                             f"the vocab_size {spec.vocab_size} of model '{spec.name}': set vocab_size: "
                             f"{tok.vocab_size} (or more) in a model YAML (model=PATH), or use a tokenizer with "
                             f"at most {spec.vocab_size} tokens")
    return tok

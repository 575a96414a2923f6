"""Byte-level tokenizer: 256 byte values plus three specials, so no vocabulary file exists."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ByteTokenizer:
    """Token id == byte value for 0..255; the specials follow."""

    bos_token_id: int = 256
    eos_token_id: int = 257
    pad_token_id: int = 258
    add_bos: bool = True

    @property
    def vocab_size(self) -> int:
        return 259

    def encode(self, text: str | bytes, add_bos: bool | None = None) -> list[int]:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        ids = list(data)
        if self.add_bos if add_bos is None else add_bos:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode_bytes(self, ids: list[int]) -> bytes:
        """Bytes of the non-special tokens (a stream may end inside a UTF-8 character)."""
        return bytes(i for i in ids if i < 256)

    def decode(self, ids: list[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def manifest(self) -> dict[str, object]:
        """What a client needs to tokenize exactly as the model was trained."""
        return {
            "type": "bytes",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "add_bos": self.add_bos,
        }


TOKENIZER = ByteTokenizer()

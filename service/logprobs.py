"""Log-probabilities as the front ends hand them out: paired with the text a client receives, and
each token written as a string (the HTTP API's `tokens`). Standard library only: the front end uses it.

The engine sends a token's log-probability with the token, but its text may come later (the first
bytes of a character, or text that could still become a stop string, are held back) or never (the
end-of-sequence token, a stop string itself). `TokenAligner` releases each token's log-probability
with the text it made, so what a client receives lists exactly the tokens of the text it received.
"""

from __future__ import annotations

from service.engine.messages import ModelInfo, TokenLogprob


class TokenAligner:
    """Pairs a request's text, as it arrives, with the log-probabilities of the byte tokens that made it.

    Specials (end of sequence) have no text and go out with the text before them; once the request
    ends, the tokens whose text never came (a stop string) are dropped."""

    def __init__(self) -> None:
        self._pending: list[TokenLogprob] = []
        self._text_bytes = 0  # bytes of text received that no token has been paired with yet

    def take(self, text: str, logprobs: list[TokenLogprob]) -> list[TokenLogprob]:
        """The log-probabilities to send with `text`, given those that arrived with it."""
        self._pending += logprobs
        self._text_bytes += len(text.encode("utf-8", "surrogatepass"))
        ready = 0
        for token in self._pending:
            if token.token_id > 255:
                ready += 1
            elif self._text_bytes > 0:
                self._text_bytes -= 1
                ready += 1
            else:
                break
        out, self._pending = self._pending[:ready], self._pending[ready:]
        return out


def aligned(text: str, logprobs: list[TokenLogprob]) -> list[TokenLogprob]:
    """A whole response's: the log-probabilities of the tokens that made `text` (see TokenAligner)."""
    return TokenAligner().take(text, logprobs)


def token_string(token_id: int, info: ModelInfo) -> str:
    """A token as the HTTP API writes it: an ASCII byte as its character, another byte as vLLM writes
    a token that is not text alone ("bytes:\\xe2"), a special by its name in tokenizer.json."""
    if token_id < 128:
        return chr(token_id)
    if token_id < 256:
        return f"bytes:\\x{token_id:02x}"
    if token_id == info.bos_token_id:
        return "<|bos|>"
    if token_id == info.eos_token_id:
        return "<|eos|>"
    return f"<|special:{token_id}|>"


def token_bytes(token_id: int) -> list[int]:
    """The UTF-8 bytes a token stands for (OpenAI's chat `bytes`): a byte token's own; a special's none."""
    return [token_id] if token_id < 256 else []

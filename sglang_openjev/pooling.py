"""Which token's hidden state the classification head reads: SGLang's rule vs Transformers'.

Pure functions on Python lists (no torch), used by tests and documentation.

SGLang (`layers/pooler.py`, `PoolingType.LAST`) pools the last token of every request in the
packed batch: index `cumsum(extend_seq_lens) - 1`. Requests are never padded inside SGLang.

Transformers' `GenericForSequenceClassification` pools, per row, the rightmost position whose
token is not `pad_token_id` (`(arange(L) * (ids != pad)).argmax(-1)`), so that right- and
left-padded batches work. On an unpadded input the two agree unless the input itself ends with
the pad id: then Transformers reads the last non-pad token before it (or position 0 when every
token is the pad id) while SGLang reads the final token. Qwen tokenizers pad with a special
token (`<|endoftext|>`) that a chat-templated NLI prompt does not end with; the server does not
rewrite inputs, so a client that sends such an input gets SGLang's (last-token) answer.
"""

from __future__ import annotations

from typing import Sequence


def sglang_last_token_indices(seq_lens: Sequence[int]) -> list[int]:
    """Flat indices SGLang's LAST pooling reads in a packed batch of `seq_lens`."""
    out, end = [], 0
    for n in seq_lens:
        if n <= 0:
            raise ValueError("every request has at least one token")
        end += n
        out.append(end - 1)
    return out


def transformers_pool_index(input_ids: Sequence[int], pad_token_id: int | None) -> int:
    """Position Transformers' GenericForSequenceClassification pools for one (unpadded) row."""
    if not input_ids:
        raise ValueError("empty input")
    if pad_token_id is None:
        return len(input_ids) - 1
    best = 0  # argmax of an all-zero row is 0
    for i, tok in enumerate(input_ids):
        if tok != pad_token_id:
            best = i
    return best


def pooling_agrees(input_ids: Sequence[int], pad_token_id: int | None) -> bool:
    """True when SGLang's last-token pooling reads the same position as Transformers'."""
    return transformers_pool_index(input_ids, pad_token_id) == len(input_ids) - 1

"""The SGLang adapter's pooled position (`sglang_openjev/pooling.py`): SGLang's last-token read of a
packed batch against Transformers' rule on a real tiny Transformers Qwen3.5 classifier. Pooling through
SGLang's own score_and_pool: tests/test_sglang_openjev_model_loading.py.
"""

from __future__ import annotations

import pytest
from _sglang_support import tiny_transformers_classifier

from sglang_openjev import pooling


# ================================================================ pooling (pure + real Transformers)
def test_sglang_last_token_indices_in_a_packed_batch():
    assert pooling.sglang_last_token_indices([3, 1, 4]) == [2, 3, 7]
    with pytest.raises(ValueError):
        pooling.sglang_last_token_indices([2, 0])


def test_pooled_position_matches_transformers_except_when_the_input_ends_with_pad():
    import torch

    model = tiny_transformers_classifier()
    pad = model.config.get_text_config().pad_token_id
    for ids in ([5, 9, 17, 4], [pad, 7, 8], [5, 9, pad], [5, pad, pad], [pad, pad]):
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
        hidden = out.hidden_states[-1][0]
        by_transformers = model.score(hidden[pooling.transformers_pool_index(ids, pad)])
        by_sglang = model.score(hidden[len(ids) - 1])
        torch.testing.assert_close(out.logits[0], by_transformers)  # the helper states Transformers' rule
        assert pooling.pooling_agrees(ids, pad) == (ids[-1] != pad)
        if ids[-1] != pad:
            torch.testing.assert_close(out.logits[0], by_sglang)
        elif set(ids) != {pad}:  # (an all-pad row embeds to zeros: both reads give zero logits)
            assert not torch.allclose(out.logits[0], by_sglang)
    assert pooling.transformers_pool_index([pad, pad], pad) == 0
    assert pooling.transformers_pool_index([3, 4], None) == 1

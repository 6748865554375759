"""Whether a draft model's vocabulary can draft for a target's, by llama.cpp's rule.

A draft proposes token ids that the target verifies as its own, so both must mean the same text
by the same id. The check is llama.cpp's `common_speculative_are_compatible`
(common/speculative.cpp), in its order:

1. the same tokenizer type (SentencePiece, byte-level BPE, ...);
2. the same add-BOS and add-EOS flags, and the same BOS and EOS ids;
3. vocabulary sizes at most SPEC_VOCAB_MAX_SIZE_DIFFERENCE (128) apart: released families pad
   their embedding tables differently (Qwen 2.5's 0.5B and 1.5B both hold 151,936 rows, other
   pairs differ by a few reserved ids);
4. equal token text for every id both have, from SPEC_VOCAB_CHECK_START_TOKEN_ID (5) on (llama.cpp
   skips the first five, where families keep differently spelled control tokens such as <unk>).

Anything else is refused with the first difference, as llama.cpp logs it. Where the sizes differ,
the decoder still never feeds either model an id it lacks: drafts past the target's vocabulary
are cut, and a committed id past the draft's silences the draft for the request
(decode/model_drafter.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ane_spec.errors import AneSpecError, untrusted

if TYPE_CHECKING:
    from ane_spec.model.tokenizer import TokenizerData

SPEC_VOCAB_MAX_SIZE_DIFFERENCE = 128
SPEC_VOCAB_CHECK_START_TOKEN_ID = 5


class VocabMismatch(AneSpecError):
    """The draft model's vocabulary cannot draft for the target's."""


def first_difference(target: "TokenizerData", draft: "TokenizerData") -> str | None:
    """The first way the two vocabularies differ by llama.cpp's rule, as a phrase; None when the
    draft may draft for the target."""
    if target.model != draft.model:
        return (f"tokenizer type: the target's is {untrusted(target.model)}, the draft's "
                f"{untrusted(draft.model)}")
    for what, t, d in (("add-BOS flag", target.add_bos_token, draft.add_bos_token),
                       ("add-EOS flag", target.add_eos_token, draft.add_eos_token),
                       ("BOS id", target.bos_token_id, draft.bos_token_id),
                       ("EOS id", target.eos_token_id, draft.eos_token_id)):
        if t != d:
            return f"{what}: the target's is {t}, the draft's {d}"
    nt, nd = len(target.tokens), len(draft.tokens)
    if abs(nt - nd) > SPEC_VOCAB_MAX_SIZE_DIFFERENCE:
        return (f"vocabulary size: the target has {nt:,} tokens, the draft {nd:,} (at most "
                f"{SPEC_VOCAB_MAX_SIZE_DIFFERENCE} apart)")
    for i in range(SPEC_VOCAB_CHECK_START_TOKEN_ID, min(nt, nd)):
        if target.tokens[i] != draft.tokens[i]:
            return (f"token {i}: the target's is {untrusted(target.tokens[i], 40)}, the draft's "
                    f"{untrusted(draft.tokens[i], 40)}")
    return None


def check_draft_vocab(target: "TokenizerData", draft: "TokenizerData", *,
                      target_name: str = "the target", draft_name: str = "the draft") -> None:
    """Raise VocabMismatch naming the first difference, unless `draft` may draft for `target`."""
    diff = first_difference(target, draft)
    if diff is not None:
        raise VocabMismatch(f"{untrusted(draft_name, 120)} cannot draft for "
                            f"{untrusted(target_name, 120)}: their vocabularies differ ({diff}); "
                            "a draft model must share the target's tokenizer (llama.cpp's "
                            "common_speculative_are_compatible)")

"""End of generation as llama.cpp derives it for a vocabulary (llama_vocab::impl::load): EOS,
EOT, EOM, the FIM pad/repo/separator tokens, and tokens named like end-of-generation markers
(`<|end|>`, `<|im_end|>`, `<|endoftext|>`, ...), which become CONTROL whatever the file says
(SmolLM2: `<|endoftext|>`, `<|im_end|>` and `<reponame>`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ane_spec.model.token_types import TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_USER_DEFINED

if TYPE_CHECKING:
    from ane_spec.model.tokenizer_data import TokenizerData

# llama-vocab.cpp's token-text scans (its "auto-detect special tokens by text"), in its order.
# Tokens with these texts become end of generation and CONTROL whatever the file says.
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
             "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>",
             "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
             "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[")
# special_eot_id / special_eom_id when the file names none (all of them are EOG_TEXTS too).
EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
             "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
             "<end_of_utterance>")
EOM_TEXTS = ("<|eom_id|>",)
# Fill-in-the-middle tokens, by kind: each kind's token (from its tokenizer.ggml.fim_*_token_id
# key, else the first token found with one of these texts) is forced to CONTROL; the pad, repo
# and file-separator ones also end generation.
FIM_KIND_TEXTS: dict[str, tuple[str, ...]] = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
            "▁<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
            "▁<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
            "▁<MID>", "<|code_middle|>", "<|middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
FIM_EOG_KINDS = ("pad", "rep", "sep")


def end_of_generation(data: TokenizerData, token_to_id: dict[str, int],
                      types: list[int]) -> set[int]:
    """The end-of-generation ids llama.cpp derives for a vocabulary (llama_vocab::impl::load),
    retyping `types` in place as it does.

    * EOT, EOM and each fill-in-the-middle kind: the id its tokenizer.ggml.*_token_id key names,
      else the token with one of its texts (EOT_TEXTS, EOM_TEXTS, FIM_KIND_TEXTS), made CONTROL.
      Where a vocabulary has several texts of one kind, llama.cpp takes whichever its hash map
      yields first; this takes the lowest id.
    * End of generation: the FIM pad, repo and separator tokens; every token whose text is in
      EOG_TEXTS (made CONTROL); EOS, EOT and EOM.
    * gpt-oss's `<|channel|>` `<|message|>` `<|start|>` `<|constrain|>` become USER_DEFINED.
    * With `<|return|>` and `<|call|>` (or `<|calls|>` and `<|flush|>`), `<|end|>` is no end of
      generation but USER_DEFINED; with `<|tool_response>` or `<|plamo:eos|>`, `</s>` is NORMAL.
    """
    def by_text(texts: tuple[str, ...]) -> int | None:
        found = [token_to_id[t] for t in texts if t in token_to_id]
        if not found:
            return None
        types[min(found)] = TOKEN_CONTROL
        return min(found)

    eot = data.eot_token_id if data.eot_token_id is not None else by_text(EOT_TEXTS)
    eom = data.eom_token_id if data.eom_token_id is not None else by_text(EOM_TEXTS)
    fim = {kind: data.fim_token_ids[kind] if kind in data.fim_token_ids else by_text(texts)
           for kind, texts in FIM_KIND_TEXTS.items()}
    eog = {fim[k] for k in FIM_EOG_KINDS if fim[k] is not None}
    for text in EOG_TEXTS:
        i = token_to_id.get(text)
        if i is not None:
            eog.add(i)
            types[i] = TOKEN_CONTROL
    for text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):
        i = token_to_id.get(text)
        if i is not None:
            types[i] = TOKEN_USER_DEFINED
    eog |= {i for i in (data.eos_token_id, eot, eom) if i is not None}

    def eog_id(text: str) -> int | None:
        i = token_to_id.get(text)
        return i if i in eog else None

    end = eog_id("<|end|>")
    calls = eog_id("<|call|>") is not None or eog_id("<|calls|>") is not None
    if end is not None and calls and (eog_id("<|return|>") is not None
                                      or eog_id("<|flush|>") is not None):
        eog.discard(end)
        types[end] = TOKEN_USER_DEFINED
    s = eog_id("</s>")
    if s is not None and (eog_id("<|tool_response>") is not None
                          or eog_id("<|plamo:eos|>") is not None):
        eog.discard(s)
        types[s] = TOKEN_NORMAL
    return eog

"""Where a long text can be cut so that a Hugging Face tokenizer gives its pieces the whole text's
ids: `HFTokenizer` then encodes a long document piece by piece, its memory bounded by the piece.
Only tokenizers whose own settings prove the cuts exact qualify (`hf_cuts_exactly`); the others
encode a text whole."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

# Where `hf_cuts_exactly` tokenizers split a text into the same tokens as whole: after a newline
# that follows a non-space and precedes a non-space (or one space and a non-space), and before a
# space that precedes a letter (the pre-tokenizer starts a word with it).
HF_CUT = re.compile(r"(?<=\S\n)(?= ?\S)|(?= [^\W\d_])")
# Pre-tokenizer regexes that cut a text at every HF_CUT, whatever surrounds it: GPT-2's (also
# ByteLevel's own with use_regex), Llama 3's (OpenAI's cl100k), Qwen 2's.
CUTTING_REGEXES = (
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# Normalizers that map each character on its own, a space or newline to itself.
LOCAL_NORMALIZERS = ("NFC", "NFD", "Lowercase")
# Pre-tokenizers that split at every HF_CUT on their own, and ones that only split further or map
# each split's characters (ByteLevel without its regex or a prefix space).
CUTTING_PRE_TOKENIZERS = ("Whitespace", "WhitespaceSplit", "BertPreTokenizer")
REFINING_PRE_TOKENIZERS = ("Digits", "Punctuation")
# Post-processors that only put special tokens before and after a single text.
WRAPPING_POST_PROCESSORS = (
    "TemplateProcessing",
    "BertProcessing",
    "RobertaProcessing",
    "ByteLevel",
)


def hf_pieces(text: str, size: int) -> Iterator[str]:
    """`text` in pieces of at least `size` characters (the last may be shorter), each cut at
    the first HF_CUT past that; a stretch without one stays in its piece, however long."""
    start = 0
    while len(text) - start > size:
        cut = HF_CUT.search(text, start + size)
        if cut is None:
            break
        yield text[start : cut.start()]
        start = cut.start()
    yield text[start:]


def hf_cuts_exactly(settings: dict[str, Any]) -> bool:
    """Whether this tokenizer.json encodes the pieces of `hf_pieces` to the whole text's ids
    (less the post-processor's special tokens): characters normalized one at a time, a
    pre-tokenizer that splits at every cut the same whatever lies past it, a model that
    tokenizes each split alone (all do), no added token spanning a cut (truncation and
    padding are off: `HFTokenizer`)."""
    added = settings.get("added_tokens") or []
    return (
        _is_local(settings.get("normalizer"))
        and _cuts_at_hf_cuts(settings.get("pre_tokenizer"))
        and not any(_may_span_a_cut(token) for token in added)
        and _kind(settings.get("post_processor")) in (None, *WRAPPING_POST_PROCESSORS)
    )


def _kind(component: dict[str, Any] | None) -> str | None:
    return None if component is None else component.get("type")


def _steps(component: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A normalizer's or pre-tokenizer's steps: a Sequence's, or itself alone."""
    if component is None:
        return []
    if _kind(component) == "Sequence":
        return component.get("normalizers") or component.get("pretokenizers") or []
    return [component]


def _is_local(normalizer: dict[str, Any] | None) -> bool:
    return all(_kind(step) in LOCAL_NORMALIZERS for step in _steps(normalizer))


def _cuts_at_hf_cuts(pre_tokenizer: dict[str, Any] | None) -> bool:
    """The first step splits at every HF_CUT (seeing the whole text: a split before it would
    end the text its regex sees), and no later one undoes a split or adds a character."""
    steps = _steps(pre_tokenizer)
    return bool(steps) and _cuts(steps[0]) and all(_cuts(s) or _refines(s) for s in steps[1:])


def _cuts(step: dict[str, Any]) -> bool:
    kind = _kind(step)
    if kind == "ByteLevel":
        return step.get("use_regex", True) and not step.get("add_prefix_space", True)
    if kind == "Split":
        return (
            step.get("pattern", {}).get("Regex") in CUTTING_REGEXES
            and step.get("behavior") == "Isolated"
            and not step.get("invert", False)
        )
    return kind in CUTTING_PRE_TOKENIZERS


def _refines(step: dict[str, Any]) -> bool:
    if _kind(step) == "ByteLevel":
        return not step.get("use_regex", True) and not step.get("add_prefix_space", True)
    return _kind(step) in REFINING_PRE_TOKENIZERS


def _may_span_a_cut(token: dict[str, Any]) -> bool:
    """An added token that could match across a cut: it holds a space and a non-space, or it
    takes the spaces beside it (lstrip, rstrip)."""
    content = token.get("content", "")
    mixed = any(c.isspace() for c in content) and not content.isspace()
    return mixed or token.get("lstrip", False) or token.get("rstrip", False)


def special_ends(tok: Any) -> tuple[list[int], list[int]] | None:
    """The ids the post-processor puts before and after a text's own (a BOS, say), or None
    when it does more than wrap the text."""
    probe = "a b"
    bare = tok.encode(probe, add_special_tokens=False).ids
    wrapped = tok.encode(probe).ids
    if not bare:  # a text with no ids of its own cannot tell where the special ones go
        return None
    for start in range(len(wrapped) - len(bare) + 1):
        if wrapped[start : start + len(bare)] == bare:
            return wrapped[:start], wrapped[start + len(bare) :]
    return None

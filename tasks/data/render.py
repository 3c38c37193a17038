"""Conversations → token ids: chat-template or raw rendering, BOS/EOS rules, truncation.

Each branch is tokenized as one canonical sequence (prompt + response together), then split
at the token level: ``prompt_ids`` are the tokens both branches share with the standalone
prompt, so BPE merges across the prompt/response boundary (common with implicit-prompt
rows, whose text prefix can end mid-token) never leave a non-canonical tokenization.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tasks.data.preference_rows import Conversation, Messages, common_prefix


@dataclass(frozen=True)
class Rendered:
    """The three texts of one pair: the prompt and each full sequence."""

    prompt: str
    chosen_full: str
    rejected_full: str


@dataclass(frozen=True)
class Tokenized:
    """Token ids of one pair; responses hold response tokens only."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    boundary_merged: bool  # BPE merged across the prompt end: prompt_ids is shorter


@dataclass(frozen=True)
class Truncation:
    """Limits: ``max_length`` per branch (prompt + response), ``max_prompt_length``."""

    max_length: int = 0  # 0 = no limit
    max_prompt_length: int = 0


def _with_system(messages: Messages, system: str | None) -> Messages:
    if system is None:
        return messages
    return [{"role": "system", "content": system}, *messages]


def _as_messages(x: str | Messages, role: str) -> Messages:
    return [{"role": role, "content": x}] if isinstance(x, str) else x


def prompt_messages(conv: Conversation) -> Messages:
    """``conv``'s prompt as chat messages, its system turn first: what the template renders
    (with the generation prompt) and each response then extends."""
    return _with_system(_as_messages(conv.prompt, "user"), conv.system)


def _text(x: str | Messages) -> str:
    return x if isinstance(x, str) else "\n\n".join(m["content"] for m in x)


class ChatTemplate:
    """The tokenizer's chat template, compiled once and rendered directly.

    transformers' ``apply_chat_template`` re-validates and copies every conversation on
    every call (most of tokenization time on short rows); this renders the same compiled
    template with the same special-token variables (a parity test pins the output).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            self.compiled = _compile_jinja_template(tokenizer.chat_template)
            # The template's globals (raise_exception, ...) and the special tokens, merged
            # once: a shared context skips jinja's per-render copy of them (3x faster).
            self.variables = {**self.compiled.environment.globals, **self.compiled.globals,
                              **tokenizer.special_tokens_map}
        except Exception:  # private API moved: fall back to the public, slower path
            self.compiled = None

    def __call__(self, messages: Messages, add_generation_prompt: bool) -> str:
        if self.compiled is None:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        context = self.compiled.new_context(
            {**self.variables, "messages": messages,
             "add_generation_prompt": add_generation_prompt}, shared=True)
        return "".join(self.compiled.root_render_func(context))


def render(conv: Conversation, template: ChatTemplate | None) -> Rendered:
    """Texts of ``conv``: through the chat template (prompt with the generation prompt,
    each response as the assistant turn) or, without one, as raw text."""
    if template is not None and not (conv.layout == "implicit" and isinstance(conv.prompt, str)):
        msgs = prompt_messages(conv)
        prompt = template(msgs, add_generation_prompt=True)
        full = [template(msgs + _as_messages(r, "assistant"), add_generation_prompt=False)
                for r in (conv.chosen, conv.rejected)]
        for f in full:
            if not f.startswith(prompt):
                raise ValueError("template_mismatch")  # template rewrites earlier turns
        return Rendered(prompt, full[0], full[1])
    prefix = f"{conv.system}\n\n" if conv.system else ""
    prompt = prefix + _text(conv.prompt)
    sep = "" if isinstance(conv.prompt, str) else "\n\n"
    return Rendered(prompt, prompt + sep + _text(conv.chosen), prompt + sep + _text(conv.rejected))


def split_tokens(prompt: list[int], chosen_full: list[int], rejected_full: list[int],
                 eos_id: int | None) -> Tokenized:
    """Split both canonical sequences at the prompt tokens all three share; add EOS to a
    response that has none."""
    k = min(common_prefix(prompt, chosen_full), common_prefix(prompt, rejected_full))
    return finish_split(chosen_full, rejected_full, k, eos_id, merged=k < len(prompt))


def finish_split(chosen_full: Sequence[int], rejected_full: Sequence[int], k: int,
                 eos_id: int | None, merged: bool) -> Tokenized:
    """Prompt = the first ``k`` tokens (shared); add EOS to a response that has none."""
    chosen, rejected = list(chosen_full[k:]), list(rejected_full[k:])
    if eos_id is not None:
        chosen = chosen if eos_id in chosen else [*chosen, eos_id]
        rejected = rejected if eos_id in rejected else [*rejected, eos_id]
    return Tokenized(list(chosen_full[:k]), chosen, rejected, boundary_merged=merged)


def truncate_prompt(prompt: list[int], limits: Truncation, bos_id: int | None,
                    room_for: int) -> tuple[list[int], list[str]]:
    """A prompt cut to ``max_prompt_length`` and to ``max_length`` less ``room_for``
    response tokens, keeping its end (and its BOS); the reasons (``truncated_prompt``)."""
    budget = limits.max_prompt_length or len(prompt)
    if limits.max_length:
        budget = min(budget, limits.max_length - room_for)
    if len(prompt) <= budget:
        return prompt, []
    keep_bos = bos_id is not None and prompt[:1] == [bos_id] and budget > 1
    tail = prompt[len(prompt) - (budget - keep_bos):] if budget - keep_bos > 0 else []
    return [bos_id] * keep_bos + tail, ["truncated_prompt"]


def render_prompt(conv: Conversation, template: ChatTemplate | None) -> str:
    """A prompt row's text as ``render`` renders a pair's prompt: through the chat template
    with the generation prompt, or raw."""
    if template is not None:
        return template(prompt_messages(conv), add_generation_prompt=True)
    prefix = f"{conv.system}\n\n" if conv.system else ""
    return prefix + _text(conv.prompt)


def truncate(t: Tokenized, limits: Truncation, bos_id: int | None
             ) -> tuple[Tokenized | None, list[str]]:
    """Apply ``limits``; return (pair or None when a response would be empty, reasons).

    The prompt keeps its end (and its BOS); each response is cut to what the prompt leaves.
    """
    prompt, reasons = truncate_prompt(t.prompt_ids, limits, bos_id, room_for=1)
    room = limits.max_length - len(prompt) if limits.max_length else None
    chosen, rejected = t.chosen_ids, t.rejected_ids
    if room is not None and len(chosen) > room:
        chosen, reasons = chosen[: max(room, 0)], [*reasons, "truncated_chosen"]
    if room is not None and len(rejected) > room:
        rejected, reasons = rejected[: max(room, 0)], [*reasons, "truncated_rejected"]
    if not chosen or not rejected or not prompt:
        return None, [*reasons, "empty_after_truncation"]
    if chosen == rejected:
        return None, [*reasons, "identical_after_truncation"]
    return Tokenized(prompt, chosen, rejected, t.boundary_merged), reasons

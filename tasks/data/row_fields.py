"""One row's fields read and checked, each problem a ``BadRow`` whose reason is a short
stable code (``missing_field:prompt``, ``wrong_type:answer``): what every layout of
tasks/data/preference_rows.py validates a row with."""

from __future__ import annotations

import hashlib
import json

ROLES = ("system", "user", "assistant")
Messages = list[dict[str, str]]


def content_id(row: dict) -> str:
    """A stable id from the row's content (for rows without one)."""
    body = json.dumps({k: v for k, v in row.items() if k != "id"}, sort_keys=True,
                      ensure_ascii=False)
    # surrogatepass: a row with a lone surrogate still gets an id, then its reject reason
    return "h-" + hashlib.sha256(body.encode("utf-8", "surrogatepass")).hexdigest()[:16]


class BadRow(ValueError):
    """Raised inside validation; carries the reason code."""


def utf8(value: str, name: str) -> str:
    if value.isascii():  # most text; a scan without a copy
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate ("\ud800" in JSON): no tokenizer takes it
        raise BadRow(f"invalid_unicode:{name}") from None
    return value


def text_field(row: dict, name: str) -> str:
    if name not in row:
        raise BadRow(f"missing_field:{name}")
    value = row[name]
    if not isinstance(value, str):
        raise BadRow(f"wrong_type:{name}")
    if not value.strip():
        raise BadRow(f"empty_field:{name}")
    return utf8(value, name)


def messages_field(row: dict, name: str, min_items: int = 1) -> Messages:
    if name not in row:
        raise BadRow(f"missing_field:{name}")
    value = row[name]
    if not isinstance(value, list) or len(value) < min_items:
        raise BadRow(f"wrong_type:{name}" if not isinstance(value, list) else f"empty_field:{name}")
    out = []
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise BadRow(f"wrong_type:{name}")
        if m.get("role") not in ROLES:
            raise BadRow("unknown_role")
        out.append({"role": m["role"], "content": utf8(m["content"], name)})
    return out


def row_id(row: dict) -> str:
    if "id" not in row:
        return content_id(row)
    if isinstance(row["id"], bool) or not isinstance(row["id"], (str, int)):
        raise BadRow("wrong_type:id")
    if not str(row["id"]).strip():
        raise BadRow("empty_field:id")
    return utf8(str(row["id"]), "id")


def system_field(row: dict) -> str | None:
    if "system" not in row or row["system"] is None:
        return None
    if not isinstance(row["system"], str):
        raise BadRow("wrong_type:system")
    return utf8(row["system"], "system") or None


def check_prompt_turns(prompt: Messages, system: str | None) -> None:
    """A prompt's turns: a system turn only first, and the user's turn last (else the
    template renders two assistant turns in a row)."""
    if any(m["role"] == "system" for m in prompt[1:]):
        raise BadRow("system_not_first")
    if system is not None and prompt[0]["role"] == "system":
        raise BadRow("system_conflict")
    if prompt[-1]["role"] != "user":
        raise BadRow("last_turn_not_user")


def prompt_only(row: dict, layout: str, system: str | None) -> str | Messages:
    """A prompt row's prompt (text, or messages ending in the user's turn); a response
    field in it is refused (a pair row missing its other response, most likely)."""
    for name in ("chosen", "rejected"):
        if name in row:
            raise BadRow(f"unexpected_field:{name}")
    if layout == "prompts":
        return text_field(row, "prompt")
    prompt = messages_field(row, "prompt")
    check_prompt_turns(prompt, system)
    return prompt


def answer_field(row: dict) -> str:
    """A prompt row's optional ``answer`` (what a verifier checks completions against);
    null or "" is none, as an empty CSV cell is; a blank one is a bad row."""
    if row.get("answer") is None or row["answer"] == "":
        return ""
    if not isinstance(row["answer"], str | int | float) or isinstance(row["answer"], bool):
        raise BadRow("wrong_type:answer")
    answer = str(row["answer"])
    if not answer.strip():
        raise BadRow("empty_field:answer")
    return utf8(answer, "answer")


def unpaired_fields(row: dict, layout: str, system: str | None
                    ) -> tuple[str | Messages, str | Messages]:
    """An unpaired row's prompt and completion (TRL's unpaired layout: text, or messages
    whose completion is the assistant's turns); a pair's response field in it is refused."""
    for name in ("chosen", "rejected"):
        if name in row:
            raise BadRow(f"unexpected_field:{name}")
    if layout == "unpaired":
        return text_field(row, "prompt"), text_field(row, "completion")
    prompt, completion = messages_field(row, "prompt"), messages_field(row, "completion")
    if any(m["role"] != "assistant" for m in completion):
        raise BadRow("response_not_assistant")
    if any(not m["content"].strip() for m in completion):
        raise BadRow("empty_response")
    check_prompt_turns(prompt, system)
    return prompt, completion


def label_field(row: dict) -> bool:
    """An unpaired row's ``label``: true (desirable) or false (undesirable), TRL's bool."""
    if row.get("label") is None:
        raise BadRow("missing_field:label")
    if not isinstance(row["label"], bool):
        raise BadRow("wrong_type:label")
    return row["label"]

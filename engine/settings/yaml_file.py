"""A settings file read as YAML (a training ``--config``, a sweep spec): every problem one
error naming the file and the line, and a key a mapping gives twice refused (YAML keeps the
last silently, so ``steps: 3`` then ``steps: 5`` would train 5 steps without a word).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def read_yaml(path: str | Path, what: str) -> Any:
    """``yaml.safe_load`` of a file; every problem (missing, unreadable, not YAML, a
    Python tag) is one error naming the file and the line: FileNotFoundError or
    ValueError."""
    import yaml

    try:
        text = Path(path).read_text()
        data = yaml.safe_load(text)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such {what}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: cannot read: {err}") from None
    except yaml.YAMLError as err:  # malformed, or a tag such as !!python/object
        mark = getattr(err, "problem_mark", None)
        line = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).replace("\n", " ")
        raise ValueError(f"{path}: not valid YAML{line}: {problem}") from None
    refuse_duplicate_keys(path, text)
    return data


def refuse_duplicate_keys(path: str | Path, text: str) -> None:
    """ValueError naming a key a mapping of the file gives twice (YAML keeps the last)."""
    import yaml

    nodes, walked = [yaml.compose(text)], set()
    while nodes:
        node = nodes.pop()
        if id(node) in walked:  # an alias: its node is walked once (``a: &x [1, *x]``)
            continue
        walked.add(id(node))
        if isinstance(node, yaml.MappingNode):
            seen: set[tuple[str, str]] = set()
            for key, value in node.value:
                if (key.tag, key.value) in seen:  # 1 and "1" are two keys
                    raise ValueError(f"{path}: key {key.value!r} given twice (line "
                                     f"{key.start_mark.line + 1}); keep one")
                seen.add((key.tag, key.value))
                nodes.append(value)
        elif isinstance(node, yaml.SequenceNode):
            nodes.extend(node.value)

"""Chat templates shipped with the recipe, for models whose own template lacks what it needs.

`policy.chat_template` names one of these files (without `.jinja`) or any Jinja file by absolute
path; null keeps the tokenizer's own template, which is what every model with a complete template
uses.
"""

from __future__ import annotations

from pathlib import Path

TEMPLATES_DIR = Path(__file__).parent


def bundled_chat_templates() -> list[str]:
    """Names of the chat templates shipped with the recipe (`policy.chat_template: <name>`)."""
    return sorted(path.stem for path in TEMPLATES_DIR.glob("*.jinja"))


def chat_template_path(value: str) -> Path:
    """The Jinja file `policy.chat_template` names: a bundled template's name, or a file path."""
    bundled = TEMPLATES_DIR / f"{value}.jinja"
    if bundled.is_file():
        return bundled
    # Absolute only: Ray workers on other nodes do not share the driver's working directory.
    path = Path(value).expanduser()
    if path.is_absolute() and path.is_file():
        return path
    raise FileNotFoundError(
        f"chat template {value!r} is neither a template shipped with the recipe "
        f"({', '.join(bundled_chat_templates())}) nor the absolute path of a Jinja file"
    )

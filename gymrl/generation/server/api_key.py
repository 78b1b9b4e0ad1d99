"""The policy server's bearer key: per run, from a file or the environment, never a fixed default.

On a cluster the policy server listens beyond loopback, so anyone who can reach the node could
otherwise generate with (and read the logits of) the model being trained. The key is therefore
never a published constant: it is read from `generation.server.api_key_file`, else from the
environment variable :data:`API_KEY_ENV`, else made fresh for the run. It is never part of the
config either, because Hydra writes the composed config (and its command-line overrides) into the
run folder and the config is sent to W&B; it travels as a `SecretStr`, whose `repr` and JSON dump
are masked, so a log line or a config dump that meets it by accident shows `**********`.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from pydantic import SecretStr

API_KEY_ENV = "GYMRL_POLICY_API_KEY"
_KEY_BYTES = 32


class ApiKeyError(ValueError):
    """The configured key source exists but gives no usable key."""


def resolve_api_key(api_key_file: str | None, environ: Mapping[str, str] = os.environ) -> SecretStr:
    """The run's key: `api_key_file`'s first line, else `$GYMRL_POLICY_API_KEY`, else a random
    256-bit key (what a run gets unless an outside client needs to know the key in advance)."""
    if api_key_file is not None:
        path = Path(api_key_file)
        try:
            key = path.read_text().strip()
        except OSError as error:
            raise ApiKeyError(
                f"generation.server.api_key_file={api_key_file!r} cannot be read "
                f"({error.strerror}); point it at a file holding the key, or leave it unset"
            ) from None
        return _usable(key, f"generation.server.api_key_file={api_key_file!r}")
    if API_KEY_ENV in environ:
        return _usable(environ[API_KEY_ENV].strip(), f"the environment variable {API_KEY_ENV}")
    return SecretStr(secrets.token_urlsafe(_KEY_BYTES))


def _usable(key: str, source: str) -> SecretStr:
    if not key or any(character.isspace() for character in key):
        raise ApiKeyError(
            f"{source} gives an empty key or one with spaces inside; write one line of printable "
            "characters (e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
        )
    return SecretStr(key)

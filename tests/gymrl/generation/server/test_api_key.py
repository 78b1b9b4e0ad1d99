"""The policy server's key: from a file, the environment, or fresh per run; never shown."""

import pytest

from gymrl.generation.server.api_key import API_KEY_ENV, ApiKeyError, resolve_api_key


def test_without_a_source_every_run_gets_a_different_strong_key():
    first, second = resolve_api_key(None, {}), resolve_api_key(None, {})
    assert first.get_secret_value() != second.get_secret_value()
    assert len(first.get_secret_value()) >= 40
    assert first.get_secret_value() not in repr(first) + str(first)


def test_a_file_wins_over_the_environment(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    key = resolve_api_key(str(key_file), {API_KEY_ENV: "from-env"})
    assert key.get_secret_value() == "from-file"
    assert resolve_api_key(None, {API_KEY_ENV: " from-env "}).get_secret_value() == "from-env"


@pytest.mark.parametrize("content", ["", "two words\n", "\n\n"])
def test_an_empty_or_spaced_key_is_refused_naming_its_source(tmp_path, content):
    key_file = tmp_path / "key"
    key_file.write_text(content)
    with pytest.raises(ApiKeyError, match=r"api_key_file=.*empty key or one with spaces"):
        resolve_api_key(str(key_file), {})
    with pytest.raises(ApiKeyError, match=API_KEY_ENV):
        resolve_api_key(None, {API_KEY_ENV: content})


def test_a_missing_file_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ApiKeyError, match=r"cannot be read .*No such file.*leave it unset"):
        resolve_api_key(str(tmp_path / "absent"), {})

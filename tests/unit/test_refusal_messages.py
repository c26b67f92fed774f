"""What a refusal says: the short quote of a refused value (providers/spec.py ``echo``), cut
to a prefix, with the value's own length, not its repr's (quotes and escapes); and the
providers it offers, without the fault injection of leasekeeper's own tests."""

from __future__ import annotations

import pytest

from providers.errors import InvalidRequest
from providers.spec import ECHO_MAX_CHARS, check_id, echo

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("size", [129, 200, 5000])
def test_a_long_value_is_quoted_with_its_own_length(size: int) -> None:
    # Before (a QA pass): 'aaaa...aaa... (131 chars)' for a 129-character id.
    quoted = echo("a" * size)
    assert quoted.endswith(f"... ({size} chars)") and len(quoted) < ECHO_MAX_CHARS + 20


def test_an_escaped_value_counts_its_characters_not_its_escapes() -> None:
    assert echo("\n" * 300).endswith("... (300 chars)")


def test_the_id_check_says_the_length_sent_without_quoting_it() -> None:
    with pytest.raises((ValueError, InvalidRequest), match=r"got a string of 129 characters$"):
        check_id("run_id", "a" * 129)


def test_a_settings_provider_list_offers_no_test_only_provider() -> None:
    from providers.errors import ConfigError
    from workers.settings import Settings, load_settings

    with pytest.MonkeyPatch.context() as env:
        env.setenv("LEASEKEEPER_PROVIDERS", "nomad")
        with pytest.raises(ConfigError, match="leasekeeper has local, kubernetes, noop ") as err:
            load_settings(read_env_file=False)
    assert "faulty" not in str(err.value)
    assert Settings(providers=["local", "faulty"]).providers == ["local", "faulty"]  # for tests

"""``steergate gateway`` refuses settings that would start and then break every request
(found from outside): each is one line naming the variable and exit 2, never a
traceback, and a gateway never starts on them. The installed command, from a folder
outside the checkout, as an operator runs it."""

from __future__ import annotations

import os

import pytest
from pydantic import SecretStr

from steergate.shared.settings import EngineSettings, GatewaySettings
from tests.harness import steergate_run

SECRETS = {
    "STEERGATE_ADMIN_KEY": "sk-sg-admin-" + "a" * 30,
    "STEERGATE_KEY_PEPPER": "p" * 32,
    "STEERGATE_ENGINE_TOKEN": "e" * 32,
}


@pytest.mark.parametrize(
    ("env", "named", "says"),
    [
        # an infinite timeout passed gt=0, then every request was a 500 (OverflowError)
        ({"STEERGATE_REDIS_TIMEOUT_S": "inf"}, "STEERGATE_REDIS_TIMEOUT_S", "finite"),
        ({"STEERGATE_LEASE_TTL_S": "inf"}, "STEERGATE_LEASE_TTL_S", "finite"),
        # an engine URL without a scheme, or with a port out of range: every request 500
        ({"STEERGATE_ENGINE_URLS": "127.0.0.1:8191"}, "STEERGATE_ENGINE_URLS", "http://"),
        ({"STEERGATE_ENGINE_URLS": "http://127.0.0.1:99999"}, "STEERGATE_ENGINE_URLS", "range"),
        ({"STEERGATE_ENGINE_URLS": "ftp://engine:8100"}, "STEERGATE_ENGINE_URLS", "http://"),
        # the refusal quoted the URL whole, credentials included (found from outside)
        ({"STEERGATE_ENGINE_URLS": "http://ops:SuperSecretPW@127.0.0.1:99999"},
         "STEERGATE_ENGINE_URLS", "range"),
        ({"STEERGATE_ENGINE_URLS": "ftp://ops:SuperSecretPW@engine:8100"},
         "STEERGATE_ENGINE_URLS", "http://"),
        # bound to port 34463 while the log said 99999; a blank host bound every interface
        ({"STEERGATE_PORT": "99999"}, "STEERGATE_PORT", "65535"),
        ({"STEERGATE_HOST": ""}, "STEERGATE_HOST", "at least 1"),
        # a blank REDIS_URL (an empty k8s secret) quietly meant one store per replica
        ({"REDIS_URL": ""}, "REDIS_URL", "set but empty"),
        # a traceback after start-up (exit 3), from the Redis client's first connect; a
        # database path that is no number quietly meant database 0 (found from outside)
        ({"REDIS_URL": "redis://:SuperSecretPW@127.0.0.1:notaport/0"}, "REDIS_URL", "port"),
        ({"REDIS_URL": "redis://:SuperSecretPW@127.0.0.1:70000/0"}, "REDIS_URL", "port"),
        ({"REDIS_URL": "redis://:SuperSecretPW@127.0.0.1:6379/abc"}, "REDIS_URL", "database"),
        ({"REDIS_URL": "redis+cluster://127.0.0.1:7000/2"}, "REDIS_URL", "database 0 only"),
        # the query was not checked (found from outside): a bad db value was a traceback
        # at start-up; a name the connection does not take (a misspelled one, a TLS one
        # on redis://) passed the start, then every request was a 500 (TypeError)
        ({"REDIS_URL": "redis://:SuperSecretPW@127.0.0.1:6379/0?db=abc"}, "REDIS_URL", "'db'"),
        ({"REDIS_URL": "unix:///tmp/redis.sock?db=x&password=SuperSecretPW"}, "REDIS_URL", "'db'"),
        ({"REDIS_URL": "redis://127.0.0.1:6379/0?timeout=1&password=SuperSecretPW"}, "REDIS_URL",
         "'timeout' is not one the gateway takes"),
        ({"REDIS_URL": "redis://127.0.0.1:6379/0?ssl_ca_certs=/ca.crt"}, "REDIS_URL",
         "needs a rediss://"),
        # socket_timeout in the URL would replace STEERGATE_REDIS_TIMEOUT_S's bound
        ({"REDIS_URL": "redis://127.0.0.1:6379/0?socket_timeout=60"}, "REDIS_URL",
         "'socket_timeout' is not one"),
        ({"REDIS_URL": "rediss://127.0.0.1:6380/0?ssl_cert_reqs=bogus"}, "REDIS_URL",
         "ssl_cert_reqs"),
        ({"REDIS_URL": "redis+cluster://127.0.0.1:7000?db=1"}, "REDIS_URL", "'db' is not one"),
        # a password typed where a name goes is never quoted
        ({"REDIS_URL": "redis://127.0.0.1:6379/0?SuperSecretPW"}, "REDIS_URL",
         "one of its query parameters"),
        # a pydantic traceback before
        ({"STEERGATE_MAX_BODY_BYTES": ""}, "STEERGATE_MAX_BODY_BYTES", "integer"),
    ],
)
def test_a_setting_that_would_break_every_request_refuses_the_start(
    env: dict[str, str], named: str, says: str
) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith("STEERGATE_")}
    base.pop("REDIS_URL", None)
    done = steergate_run(
        ["gateway"], {**SECRETS, **env}, base_env=base, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("steergate gateway: refusing to start: ") and f"{named}:" in line
    assert says in line, line
    assert "SuperSecretPW" not in done.stderr + done.stdout  # never the URL's password


def test_a_flag_does_not_hide_a_bad_setting_it_replaces_and_is_named_as_the_flag() -> None:
    """With --port given, STEERGATE_PORT=abc was never read: the start went on without a
    word, and the next start without the flag failed. And a bad --port was reported as
    STEERGATE_PORT, a variable the operator never set."""
    done = steergate_run(["gateway", "--port", "9"], {**SECRETS, "STEERGATE_PORT": "abc"},
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2, (done.stdout, done.stderr)
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("steergate gateway: refusing to start: STEERGATE_PORT:"), line
    done = steergate_run(["gateway", "--port", "99999"], SECRETS,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "argument --port: not a port: '99999' (1-65535)" in done.stderr, done.stderr
    assert "STEERGATE_PORT" not in done.stderr


def test_an_unknown_log_level_is_a_usage_error_not_a_traceback() -> None:
    done = steergate_run(
        ["gateway", "--log-level", "trace"], SECRETS, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "invalid choice" in done.stderr
    assert "Traceback" not in done.stderr


def test_bearer_secrets_lose_surrounding_whitespace_and_blank_is_unset() -> None:
    """A key read from a file keeps its newline, which no client sends: the gateway
    started and answered every admin call 401."""
    s = GatewaySettings(
        admin_key=SecretStr(" sk-sg-admin\n"),
        engine_token=SecretStr("tok\n"),
        metrics_token=SecretStr("   "),
        key_pepper=SecretStr("pepper\n"),  # hashed into every stored key: as it is
        redis_url=None,
    )
    assert s.admin_key is not None and s.admin_key.get_secret_value() == "sk-sg-admin"
    assert s.engine_token is not None and s.engine_token.get_secret_value() == "tok"
    assert s.metrics_token is None
    assert s.key_pepper is not None and s.key_pepper.get_secret_value() == "pepper\n"
    engine = EngineSettings(engine_token=SecretStr("tok\r\n"))
    assert engine.engine_token is not None and engine.engine_token.get_secret_value() == "tok"


def test_an_engine_named_twice_is_one_engine() -> None:
    s = GatewaySettings(engine_urls="http://e:8100, http://e:8100/ ,https://f:443", redis_url=None)
    assert s.engine_url_list == ["http://e:8100", "https://f:443"]

"""``steergate engine`` builds vLLM's argv and environment; no engine is started."""

from __future__ import annotations

import sys

import pytest

from steergate.engine import launch


def test_defaults_are_added_only_where_the_user_gave_none() -> None:
    cmd = launch.build_command(["--model", "/m", "--dtype", "float32"], python="py")
    assert cmd[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--port") + 1] == "8100"
    assert cmd[cmd.index("--served-model-name") + 1] == "/m"
    assert "--enforce-eager" not in cmd and "--api-key" not in cmd
    user = launch.build_command(["--model=/m", "--port", "9000", "--served-model-name", "x"])
    assert user.count("--port") == 1 and "9000" in user
    assert user.count("--served-model-name") == 1


def test_env_names_our_plugins_and_keeps_user_settings() -> None:
    env = launch.build_env({"VLLM_CPU_KVCACHE_SPACE": "8", "VLLM_PLUGINS": "other"})
    assert env["VLLM_PLUGINS"] == "steergate"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "8"
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert launch.build_env({})["VLLM_CPU_KVCACHE_SPACE"] == launch.DEFAULT_CPU_KVCACHE_GIB


def test_refuses_to_start_without_the_engine_token(monkeypatch, capsys) -> None:
    monkeypatch.delenv("STEERGATE_ENGINE_TOKEN", raising=False)
    monkeypatch.setattr(launch.os, "execvpe", lambda *a: pytest.fail("must not exec"))
    assert launch.main(["--model", "/m"]) == 2
    assert "STEERGATE_ENGINE_TOKEN" in capsys.readouterr().err


def test_execs_vllm_when_the_token_is_set(monkeypatch) -> None:
    seen = {}
    monkeypatch.setenv("STEERGATE_ENGINE_TOKEN", "t")
    monkeypatch.setattr(
        launch.os, "execvpe", lambda f, argv, env: seen.update(f=f, argv=argv, env=env)
    )
    launch.main(["--model", "/m"])
    assert seen["f"] == sys.executable and seen["env"]["VLLM_PLUGINS"] == "steergate"


def test_rejects_api_key_and_missing_model(monkeypatch) -> None:
    monkeypatch.setenv("STEERGATE_ENGINE_TOKEN", "t")
    monkeypatch.setattr(launch.os, "execvpe", lambda *a: pytest.fail("must not exec"))
    assert launch.main(["--model", "/m", "--api-key", "k"]) == 2
    assert launch.main(["--port", "1"]) == 2


def test_no_steering_flag_becomes_the_setting_and_is_not_passed_to_vllm() -> None:
    args, env = launch.apply_no_steering(["--model", "/m", "--no-steering"], {"A": "1"})
    assert args == ["--model", "/m"] and env == {"A": "1", "STEERGATE_STEERING": "off"}
    assert launch.apply_no_steering(["--model", "/m"], {}) == (["--model", "/m"], {})

"""One error vocabulary: every code the gateway, the engine or shared code raises is in
the registry (``steergate/shared/errors.py``), every registered code is used somewhere, and
docs/api.md's table is the registry's (``scripts/error_table.py``)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from scripts import error_table
from steergate.shared import errors

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "steergate"
SOURCES = sorted(p for d in ("gateway", "engine", "shared") for p in (PACKAGE / d).rglob("*.py"))
#: Calls that take an error code, and where: (positional index, keyword).
CODE_ARGS = {
    "APIError": (0, "code"),
    "EngineUnreachable": (0, "code"),
    "InvalidField": (2, "code"),
    "cache_miss": (0, "code"),
    "error_body": (3, "code_"),
    "retry_headers": (0, "code"),
}


def _name(func: ast.expr) -> str:
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")


def _calls() -> list[tuple[Path, ast.Call]]:
    out = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and _name(node.func) in CODE_ARGS:
                out.append((path, node))
    return out


def _code_of(call: ast.Call) -> ast.expr | None:
    index, keyword = CODE_ARGS[_name(call.func)]
    for kw in call.keywords:
        if kw.arg == keyword:
            return kw.value
    return call.args[index] if len(call.args) > index else None


def test_every_raised_code_is_registered() -> None:
    unknown = []
    for path, call in _calls():
        code = _code_of(call)
        if isinstance(code, ast.Constant) and code.value not in errors.REGISTRY:
            unknown.append(f"{path.relative_to(ROOT)}:{call.lineno}: {code.value!r}")
    where = "codes raised but not in steergate/shared/errors.py REGISTRY:\n"
    assert not unknown, where + "\n".join(unknown)


def test_the_status_comes_from_the_registry_not_the_caller() -> None:
    with pytest.raises(TypeError):
        errors.APIError("not_found", "x", "a third positional value")  # type: ignore[misc]
    assert errors.APIError("not_found", "x", status=418).status == 404
    assert errors.APIError("http_error", "x", status=418).status == 418


def test_render_sends_the_body_status_and_retry_headers() -> None:
    exc = errors.APIError("rate_limit_exceeded", "slow down", retry_after_ms=1500)
    out = errors.render(exc)
    assert out.status == 429
    assert json.loads(out.body) == exc.body()
    assert out.headers["content-type"] == "application/json"
    assert out.headers["retry-after"] == "2" and out.headers["x-should-retry"] == "true"
    assert (b"content-length", str(len(out.body)).encode()) in out.raw_headers()


def test_every_registered_code_is_used_somewhere() -> None:
    """A string constant outside the registry's own table: raised, mapped (vLLM's
    statuses, the limiter's rejections) or consumed (the engine's cache misses)."""
    used: set[str] = set()
    for path in SOURCES:
        tree = ast.parse(path.read_text(), str(path))
        skip: set[int] = set()
        if path == PACKAGE / "shared" / "errors.py":
            for node in ast.walk(tree):
                if isinstance(node, ast.Assign) and any(
                    getattr(t, "id", "") == "_CODES" for t in node.targets
                ):
                    skip = {id(n) for n in ast.walk(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if id(node) not in skip:
                    used.add(node.value)
    unused = sorted(set(errors.REGISTRY) - used)
    assert not unused, f"registered but never used: {unused}"


def test_registry_statuses_and_types_are_consistent() -> None:
    for code, entry in errors.REGISTRY.items():
        assert entry.code == code
        if entry.status:
            assert 400 <= entry.status <= 599
            assert entry.type.endswith("_error")
            assert (entry.status >= 500) == (entry.type == "server_error"), code
        assert entry.when and "|" not in entry.when
    for status, code in errors._BY_STATUS.items():
        assert errors.REGISTRY[code].status == status


def test_docs_error_table_is_the_registry() -> None:
    doc = (ROOT / "docs" / "api.md").read_text()
    assert error_table.current_section(doc) == error_table.section(), (
        "run: python scripts/error_table.py --write"
    )
    for code in errors.REGISTRY:
        assert f"| `{code}` |" in doc


def test_api_error_takes_status_type_and_retry_headers_from_the_registry() -> None:
    e = errors.APIError("vector_quota_exceeded", "full")
    assert (e.status, e.type) == (429, "rate_limit_error")
    assert e.headers == {"x-should-retry": "false"}
    e = errors.APIError("rate_limit_exceeded", "slow down", retry_after_ms=1500)
    assert e.headers == {"x-should-retry": "true", "retry-after": "2", "retry-after-ms": "1500"}
    assert errors.APIError("engine_unavailable", "x").headers == {"x-should-retry": "true"}
    assert errors.InvalidField("a", "b", "unknown_vector").status == 400


def test_foreign_errors_are_normalized() -> None:
    vllm = {"error": {"message": "m", "type": "BadRequestError", "param": "n", "code": 400}}
    assert errors.normalize_error(400, vllm)["error"] == {
        "message": "m",
        "type": "invalid_request_error",
        "param": "n",
        "code": "invalid_request",
    }
    not_found = {"error": {"message": "m", "type": "NotFoundError", "param": "model", "code": 404}}
    assert errors.normalize_error(404, not_found)["error"]["code"] == "model_not_found"
    assert errors.normalize_error(404, None, "Not Found")["error"]["code"] == "not_found"
    assert errors.normalize_error(503, {"detail": "busy"})["error"]["code"] == "engine_overloaded"
    # A registered code that does not fit the status is replaced by one that does.
    wrong = {"error": {"message": "m", "code": "invalid_json"}}
    assert errors.normalize_error(500, wrong)["error"]["code"] == "internal_error"
    assert errors.normalize_error(418, None)["error"]["code"] == "http_error"

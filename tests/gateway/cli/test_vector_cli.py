"""``steergate vector from-examples``: example files (JSON lines or one text per line),
layer ranges, and a run against a live gateway (stub engine with capture) through the
real entry point ``steergate.cli.main``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx
import pytest

from steergate.cli.main import main
from steergate.cli.vector import ExampleFileError, parse_layers, read_examples
from tests.gateway.conftest import make_tenant
from tests.gateway.servers import ServerThread

OCEAN = ["the ocean waves", "ocean tides roll", "deep ocean blue"]
CITY = ["the city streets", "traffic downtown", "tall buildings"]


def test_plain_text_file_is_one_example_per_line(tmp_path: Path) -> None:
    f = tmp_path / "pos.txt"
    f.write_text("the ocean\n\n  42  \n{not json}\n", encoding="utf-8")
    # One line is valid JSON (42) but not a string or list: the whole file is text.
    assert read_examples(f) == ["the ocean", "42", "{not json}"]


def test_json_lines_file_holds_texts_and_messages(tmp_path: Path) -> None:
    f = tmp_path / "pos.jsonl"
    msgs = [{"role": "user", "content": "hi\nthere"}]
    f.write_text(json.dumps("a text") + "\n" + json.dumps(msgs) + "\n", encoding="utf-8")
    assert read_examples(f) == ["a text", msgs]


def test_empty_or_missing_file_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("\n \n", encoding="utf-8")
    with pytest.raises(ExampleFileError, match="no examples"):
        read_examples(tmp_path / "empty.txt")
    with pytest.raises(ExampleFileError, match="cannot read"):
        read_examples(tmp_path / "missing.txt")


def test_layer_ranges() -> None:
    assert parse_layers("all") == "all"
    assert parse_layers("8-11") == [8, 9, 10, 11]
    assert parse_layers("1,3-4") == [1, 3, 4]
    assert len(parse_layers("0-1023")) == 1024


def test_a_huge_layer_range_is_a_usage_error_not_a_memory_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found from outside: ``--layers 0-1000000000`` built a list of 10^9 ints
    (MemoryError traceback) before the gateway could say the model has 30 layers."""
    # (the bound is what is tested: 10^9 itself, were the bound gone, would take the
    # machine's memory rather than fail)
    with pytest.raises(argparse.ArgumentTypeError, match="more than 1024 layers"):
        parse_layers("0-1024")
    with pytest.raises(argparse.ArgumentTypeError, match="more than 1024 layers"):
        parse_layers("0-600,601-1200")
    monkeypatch.setenv("STEERGATE_API_KEY", "sk-sg-x")
    f = tmp_path / "x.txt"
    f.write_text("a\nb\n", encoding="utf-8")
    argv = ["vector", "from-examples", "v", "--positive", str(f), "--negative", str(f)]
    assert main([*argv, "--layers", "0-5000"]) == 2
    assert "more than 1024 layers" in capsys.readouterr().err


def test_a_key_no_header_can_carry_says_which_variable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found from outside: a non-ASCII STEERGATE_API_KEY was a UnicodeEncodeError
    traceback."""
    monkeypatch.setenv("STEERGATE_API_KEY", "ké€y")
    f = tmp_path / "x.txt"
    f.write_text("a\nb\n", encoding="utf-8")
    code = main(["vector", "from-examples", "v", "--positive", str(f), "--negative", str(f)])
    err = capsys.readouterr().err
    assert code == 2 and "STEERGATE_API_KEY holds characters" in err and "ké€y" not in err


def test_from_examples_makes_the_vector_and_prints_the_report(
    gateway: ServerThread,
    redis_url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    key = make_tenant(redis_url, "acme")
    pos, neg = tmp_path / "pos.txt", tmp_path / "neg.jsonl"
    pos.write_text("\n".join(OCEAN), encoding="utf-8")
    neg.write_text("\n".join(json.dumps([{"role": "user", "content": c}]) for c in CITY))
    monkeypatch.setenv("STEERGATE_API_KEY", key)
    argv = ["vector", "from-examples", "sea", "--positive", str(pos), "--negative", str(neg)]
    code = main([*argv, "--layers", "1-2", "--url", gateway.url, "--description", "waves"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "separation" in out and "mean_difference over 3 positive / 3 negative" in out
    doc = httpx.get(
        gateway.url + "/v1/steering/vectors/sea", headers={"Authorization": f"Bearer {key}"}
    ).json()
    assert doc["layers"] == [1, 2] and doc["description"] == "waves"
    assert doc["provenance"]["counts"] == {"positive": 3, "negative": 3}
    # A refusal is a clear error naming the field, exit 1.
    code = main([*argv, "--layers", "99", "--url", gateway.url])
    _, err = capsys.readouterr()
    assert code == 1 and "layers[0]" in err
    # A name is one path segment: ".." was resolved by the client into another route.
    code = main(["vector", "from-examples", "..", *argv[3:], "--url", gateway.url])
    _, err = capsys.readouterr()
    assert code == 2 and "not a vector name" in err


def test_without_a_key_it_says_which_variable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("STEERGATE_API_KEY", raising=False)
    f = tmp_path / "x.txt"
    f.write_text("a\nb\n", encoding="utf-8")
    code = main(["vector", "from-examples", "v", "--positive", str(f), "--negative", str(f)])
    assert code == 2 and "STEERGATE_API_KEY" in capsys.readouterr().err

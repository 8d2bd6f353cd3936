"""``steergate vector from-examples NAME --positive FILE --negative FILE``: a tenant
command (the tenant's key in ``STEERGATE_API_KEY``) that makes a named steering
vector from example files through the gateway and prints its per-layer report.

An example file is either JSON lines (every non-blank line a JSON string or a
messages list) or plain text (one example per line). The choice is made per file:
if any non-blank line is not a JSON string or array, every line is read as text, so
a text line that happens to be valid JSON (``42``) is never misread.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import orjson
from rich.table import Table

from steergate.cli.admin import DEFAULT_URL, CLIError, check_key, path_segment
from steergate.cli.tables import console
from steergate.shared.settings import display_url

HOOKS = ("pre_attn", "post_attn", "post_block")
#: Making a vector runs every example through the model: minutes on a busy CPU.
TIMEOUT_S = 900.0


class ExampleFileError(ValueError):
    pass


def read_examples(path: Path) -> list[Any]:
    """The examples in ``path``: JSON lines or one text per line (see module doc)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ExampleFileError(f"cannot read {path}: {exc}") from exc
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise ExampleFileError(f"{path} holds no examples")
    parsed: list[Any] = []
    for line in lines:
        try:
            value = orjson.loads(line)
        except orjson.JSONDecodeError:
            return [line.strip() for line in lines]
        if not isinstance(value, (str, list)):
            return [line.strip() for line in lines]
        parsed.append(value)
    return parsed


#: Layers one --layers may name: far above any model's (the gateway checks the model's).
MAX_LAYERS = 1024


def parse_layers(text: str) -> list[int] | str:
    """``all``, ``8-15``, ``1,3,5`` or a mix (``1,8-10``)."""
    if text.strip() == "all":
        return "all"
    out: list[int] = []
    try:
        for part in text.split(","):
            lo, sep, hi = part.strip().partition("-")
            first, last = (int(lo), int(hi)) if sep else (int(lo), int(lo))
            if last - first + 1 + len(out) > MAX_LAYERS:
                # 0-1000000000 built a list of 10^9 ints (MemoryError) before the
                # gateway could say the model has 30 layers.
                raise argparse.ArgumentTypeError(
                    f"layers name more than {MAX_LAYERS} layers; got {text!r}"
                )
            out.extend(range(first, last + 1))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"layers must be 'all', N, N-M or a comma list of those; got {text!r}"
        ) from exc
    return out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="steergate vector",
        description="Tenant commands for named steering vectors.",
        epilog="STEERGATE_API_KEY must hold the tenant's API key.",
    )
    sub = parser.add_subparsers(dest="action", required=True)
    make = sub.add_parser(
        "from-examples",
        help="make a vector from positive and negative example files",
        description="Make (or replace) the named vector from contrastive examples.",
    )
    make.add_argument("name")
    make.add_argument("--positive", type=Path, required=True, help="examples file (positive)")
    make.add_argument("--negative", type=Path, required=True, help="examples file (negative)")
    make.add_argument("--layers", type=parse_layers, default="all", help="e.g. 8-15 (default all)")
    make.add_argument("--hook", choices=HOOKS, default="post_block")
    make.add_argument("--method", choices=("mean_difference", "pca"), default="mean_difference")
    make.add_argument("--position", choices=("mean", "last"), default="mean")
    make.add_argument("--normalize", action="store_true", help="store unit-length vectors")
    make.add_argument("--description")
    make.add_argument(
        "--url",
        default=os.environ.get("STEERGATE_GATEWAY_URL", DEFAULT_URL),
        help=f"gateway base URL (default: env STEERGATE_GATEWAY_URL, else {DEFAULT_URL})",
    )
    make.add_argument("--json", action="store_true", help="print the API's JSON")
    return parser


def request_body(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {
        "hook": args.hook,
        "layers": args.layers,
        "positive": read_examples(args.positive),
        "negative": read_examples(args.negative),
        "method": args.method,
        "position": args.position,
        "normalize": args.normalize,
    }
    if args.description is not None:
        body["description"] = args.description
    return body


def main(argv: Sequence[str]) -> int:
    try:
        args = _parser().parse_args(list(argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    err = console(stderr=True)
    key = os.environ.get("STEERGATE_API_KEY", "")
    if not key:
        err.print("error: set STEERGATE_API_KEY to the tenant's API key", markup=False)
        return 2
    try:
        body = request_body(args)
    except ExampleFileError as exc:
        err.print(f"error: {exc}", markup=False)
        return 2
    try:
        check_key(key, "STEERGATE_API_KEY")
        name = path_segment(args.name, "vector name")
    except CLIError as exc:
        err.print(f"error: {exc}", markup=False)
        return exc.exit_code
    url = f"{args.url.rstrip('/')}/v1/steering/vectors/{name}/from-examples"
    try:
        r = httpx.post(
            url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=TIMEOUT_S
        )
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        err.print(
            f"error: cannot reach the gateway at {display_url(args.url)}: {type(exc).__name__}"
            " (set STEERGATE_GATEWAY_URL or --url)",
            markup=False,
        )
        return 1
    if r.status_code >= 400:
        err.print(f"error: {_describe(r)}", markup=False)
        return 1
    out = console()
    try:
        doc = r.json()
    except ValueError:
        err.print(
            f"error: {display_url(args.url)} answered {r.status_code} with something that is "
            "not JSON: "
            "is it the gateway? (set STEERGATE_GATEWAY_URL or --url)",
            markup=False,
        )
        return 1
    if args.json:
        out.print_json(data=doc)
    else:
        out.print(report_table(doc))
        out.print(summary(doc), markup=False)
    return 0


def _describe(r: httpx.Response) -> str:
    try:
        e = r.json()["error"]
        param = f", field {e['param']}" if e.get("param") else ""
        return f"{e['message']} [{r.status_code} {e.get('code')}{param}]"
    except (ValueError, KeyError, TypeError):
        return f"gateway answered {r.status_code}"


def report_table(doc: dict[str, Any]) -> Table:
    table = Table(title=f"vector {doc['name']} ({doc['hook']})")
    for col in ("layer", "norm", "separation", "accuracy"):
        table.add_column(col, justify="right")
    layers = doc["report"]["layers"]
    for layer in sorted(layers, key=int):
        row = layers[layer]
        sep = row["separation"]
        table.add_row(
            layer,
            f"{row['norm']:.3f}",
            "-" if sep is None else f"{sep:.2f}",
            f"{row['accuracy']:.2f}",
        )
    return table


def summary(doc: dict[str, Any]) -> str:
    ex, usage, prov = doc["report"]["examples"], doc["report"]["usage"], doc["provenance"]
    return (
        f"{prov['method']} over {ex['positive']} positive / {ex['negative']} negative examples"
        f" ({prov['position']} position) on {prov['model']}; {usage['total_tokens']} tokens. "
        f'Steer with {{"name": "{doc["name"]}", "scale": ...}}.'
    )

"""The ``steergate`` command: one entry point, each sub-command imported lazily so
that ``steergate gateway`` never imports torch and ``steergate engine`` never
imports the gateway."""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib import import_module

USAGE = """usage: steergate COMMAND [ARGS...]

commands:
  engine --model PATH_OR_HF_ID [--port 8100] [vLLM args...]   stock vLLM + steering plugins
  gateway [--port 8080]                                      the multi-tenant gateway
  up [--model PATH_OR_HF_ID]                                 engine + gateway + demo tenant
  tiny-model DIR                                             write a small random Llama
  real-model [DIR]                                           fetch + convert SmolLM2-135M-Instruct
  tenant create|list|show|update|delete ...                  admin: tenants (delete: --yes)
  key create|list|revoke|rotate ...                          admin: API keys
  admin-key create|list|revoke ...                           admin: admin/viewer keys
  audit [--since WHEN] [--limit N]                           admin: the audit log
  usage [TENANT]                                             admin: usage tables
  vector from-examples NAME --positive F --negative F        tenant: make a vector from examples

Every command takes --help (e.g. `steergate tenant create --help`). The admin
commands need STEERGATE_ADMIN_KEY, the tenant commands STEERGATE_API_KEY; --url or
STEERGATE_GATEWAY_URL names the gateway; --json prints the API's JSON; tables are
never cut when stdout is not a terminal.
"""

COMMANDS: dict[str, str] = {
    "engine": "steergate.engine.launch:main",
    "tiny-model": "steergate.engine.tiny_model:main",
    "real-model": "steergate.engine.real_model:main",
    "gateway": "steergate.gateway.server:main",
    "up": "steergate.cli.up:main",
    "tenant": "steergate.cli.admin:tenant_main",
    "key": "steergate.cli.admin:key_main",
    "admin-key": "steergate.cli.admin:admin_key_main",
    "audit": "steergate.cli.admin:audit_main",
    "usage": "steergate.cli.admin:usage_main",
    "vector": "steergate.cli.vector:main",
}


def _resolve(target: str) -> Callable[[list[str]], int | None]:
    module, func = target.split(":")
    return getattr(import_module(module), func)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help", "help"}:
        print(USAGE)
        return 0
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(f"steergate: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return int(_resolve(COMMANDS[command])(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())

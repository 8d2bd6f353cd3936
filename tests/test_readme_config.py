"""README.md documents exactly the environment the code reads, and links only to
files that exist."""

from __future__ import annotations

import re
from pathlib import Path

from scripts import config_table
from steergate.shared.settings import EngineSettings, GatewaySettings

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_readme_config_table_lists_exactly_the_settings_env_names() -> None:
    section = config_table.current_section(README)
    assert section is not None, "README.md lacks the config-table markers"
    listed = re.findall(r"^\| `([A-Z0-9_]+)` \|", section, re.M)
    expected = config_table.env_names(GatewaySettings) | config_table.env_names(EngineSettings)
    assert len(listed) == len(set(listed)), "a variable is listed twice"
    assert set(listed) == expected


def test_readme_config_table_is_current() -> None:
    assert config_table.current_section(README) == config_table.section(), (
        "run: python scripts/config_table.py --write"
    )


def test_readme_links_point_at_existing_files() -> None:
    targets = re.findall(r"\]\(((?:docs/)[^)#\s]+)\)", README)
    assert "docs/architecture.md" in targets and "docs/img/dashboard-admin.png" in targets
    missing = sorted({t for t in targets if not (ROOT / t).exists()})
    assert not missing, f"README links to missing files: {missing}"

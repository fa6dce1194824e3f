"""`python -m tui [--url URL] [--api-key KEY] [--data-dir DIR]`: the console without the CLI
(`appliance top` calls the same `run_console`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tui.app import run_console


def console_main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tui", description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--api-key", default=None, help="operator key (default: the data dir's)")
    parser.add_argument("--data-dir", type=Path, default=None)
    args = parser.parse_args()
    run_console(args.url, args.api_key, args.data_dir)


if __name__ == "__main__":
    console_main()

"""`kvstack ui screenshot`: pictures of the live view (`/ui`) for the docs (docs/ui).

Without `--url` it serves the model itself (no API keys; a temporary disk tier unless
`--kv-disk-dir` is given, so the pictures show tier marks), sends some traffic, drives
Debian's headless Chromium through the page and writes one PNG per view into `--out`.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from kvstack.cli.args import add_model_args, load_llm


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "ui", help="the live view of the cache: screenshots for the docs",
        description="The live view is served by `kvstack serve` at /ui. `kvstack ui "
        "screenshot` writes PNGs of it (overview, pool, tree, charts, playground); it needs "
        "Debian's chromium and chromium-driver and selenium (`make install` sets them up).")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    shot = commands.add_parser("screenshot", help="write PNGs of every view",
                               description="Serve the model (or use --url), send traffic, "
                               "and save one PNG per view of /ui.")
    shot.add_argument("--out", type=Path, default=Path("docs/ui"), metavar="DIR",
                      help="folder for the PNGs")
    shot.add_argument("--url", default=None, metavar="URL",
                      help="a running `kvstack serve` to picture instead of serving one here")
    shot.add_argument("--key", default=None, metavar="KEY",
                      help="with --url: the key the page (and the traffic) use")
    add_model_args(shot, cache_switches=False)
    shot.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from kvstack.ui.browser import chromium_driver, chromium_paths
    from kvstack.ui.screenshots import take_screenshots

    chromium_paths()  # a missing browser fails before the model loads
    with tempfile.TemporaryDirectory(prefix="kvstack-ui-") as tmp:
        driver = chromium_driver(Path(tmp) / "profile")
        try:
            if args.url:
                files = take_screenshots(driver, args.url.rstrip("/"), args.out, args.key)
            else:
                files = _serve_and_shoot(args, driver, Path(tmp))
        finally:
            driver.quit()
    for path in files:
        print(path)
    return 0


def _serve_and_shoot(args: argparse.Namespace, driver: Any, tmp: Path) -> list[Path]:
    from kvstack.server.app import create_app
    from kvstack.server.threaded import ServerThread
    from kvstack.ui.screenshots import take_screenshots

    overrides = {} if args.kv_disk_dir else {"kv_disk_dir": str(tmp / "kv")}
    llm = load_llm(args, **overrides)
    try:
        with ServerThread(create_app(llm)) as url:
            return take_screenshots(driver, url, args.out, model=args.model)
    finally:
        llm.close()

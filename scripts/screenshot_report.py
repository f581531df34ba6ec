#!/usr/bin/env python3
"""Open a `dspark-export report` page in headless Chromium and save a PNG screenshot.

Before the screenshot every <img> of the page is checked: a data URI must decode to a PNG (signature and
IHDR size), a relative file must exist next to the page and be a PNG. A broken image exits 1 naming it.

Needs Chromium (Debian: `apt-get install -y chromium`). Runs it with a fresh profile folder and no
network-facing background services.

Usage:
    python scripts/screenshot_report.py engines/smollm2/report/index.html --out report.png
    python scripts/screenshot_report.py /tmp/r/index.html --out shot.png --width 1280 --height 7000
"""

from __future__ import annotations

import argparse
import base64
import shutil
import struct
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


class _Images(HTMLParser):
    def __init__(self):
        super().__init__()
        self.srcs: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.srcs.append(dict(attrs).get("src") or "")


def png_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) of a PNG, or None when `data` is not one."""
    if len(data) < 24 or not data.startswith(PNG_SIGNATURE) or data[12:16] != b"IHDR":
        return None
    return struct.unpack(">II", data[16:24])


def check_images(page: Path) -> list[str]:
    """One line per image: 'ok <what> <w>x<h>' or 'BROKEN <what>: <why>'."""
    parser = _Images()
    parser.feed(page.read_text(encoding="utf-8"))
    lines = []
    for n, src in enumerate(parser.srcs, 1):
        what = f"img #{n}"
        if src.startswith("data:image/png;base64,"):
            try:
                data = base64.b64decode(src.split(",", 1)[1], validate=True)
            except ValueError as e:
                lines.append(f"BROKEN {what}: bad base64 ({e})")
                continue
        elif src and "://" not in src and not src.startswith("data:"):
            path = page.parent / src
            if not path.is_file():
                lines.append(f"BROKEN {what}: {src} does not exist")
                continue
            data, what = path.read_bytes(), f"{what} ({src})"
        else:
            lines.append(f"BROKEN {what}: unsupported source {src[:40]!r}")
            continue
        size = png_size(data)
        lines.append(f"ok {what} {size[0]}x{size[1]}" if size else f"BROKEN {what}: not a PNG")
    return lines


def find_browser(name: str | None) -> str:
    for candidate in ([name] if name else BROWSERS):
        path = shutil.which(candidate)
        if path:
            return path
    raise SystemExit(f"screenshot_report: no Chromium found (tried {', '.join([name] if name else BROWSERS)}); "
                     "install it with `apt-get install -y chromium`")


def screenshot(page: Path, out: Path, width: int, height: int, browser: str, timeout: int) -> None:
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
               f"--user-data-dir={profile}", f"--window-size={width},{height}", f"--screenshot={out}",
               page.resolve().as_uri()]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not out.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise SystemExit(f"screenshot_report: {browser} exited {proc.returncode} without a screenshot: "
                         + " | ".join(tail))


def trim_bottom(path: Path, margin: int = 24) -> None:
    """Cut the blank rows below the page's content (the window is taller than the page); needs Pillow,
    otherwise the shot is kept as it is."""
    try:
        from PIL import Image, ImageChops
    except ImportError:
        return
    with Image.open(path) as im:
        rgb = im.convert("RGB")
    box = ImageChops.difference(rgb, Image.new("RGB", rgb.size, rgb.getpixel((rgb.width - 1, rgb.height - 1)))).getbbox()
    if box and box[3] + margin < rgb.height:
        rgb.crop((0, 0, rgb.width, box[3] + margin)).save(path, optimize=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("Usage:")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("page", type=Path, help="the report's index.html")
    p.add_argument("--out", type=Path, required=True, help="PNG screenshot to write")
    p.add_argument("--width", type=int, default=1280, help="window width in pixels (1280)")
    p.add_argument("--height", type=int, default=8000,
                   help="window height in pixels (8000); blank rows below the page are cut unless --no-trim")
    p.add_argument("--browser", default=None, help="browser executable (default: the first Chromium on PATH)")
    p.add_argument("--no-trim", action="store_true", help="keep the blank rows below the page")
    p.add_argument("--timeout", type=int, default=120, help="seconds before the browser is given up on (120)")
    args = p.parse_args(argv)
    if not args.page.is_file():
        print(f"screenshot_report: {args.page}: no such file", file=sys.stderr)
        return 2
    lines = check_images(args.page)
    for line in lines:
        print(line)
    broken = [line for line in lines if line.startswith("BROKEN")]
    if not lines:
        print(f"screenshot_report: {args.page} has no images", file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    screenshot(args.page, args.out, args.width, args.height, find_browser(args.browser), args.timeout)
    if not args.no_trim:
        trim_bottom(args.out)
    size = png_size(args.out.read_bytes())
    print(f"wrote {args.out} ({size[0]}x{size[1]}, {args.out.stat().st_size} bytes)")
    return 1 if broken or not lines else 0


if __name__ == "__main__":
    sys.exit(main())

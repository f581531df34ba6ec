#!/usr/bin/env python3
"""Open a `dspark-export report` page in headless Chromium and save a PNG screenshot.

Every <img> of the page is checked twice. In the file: a data URI must decode to a PNG (signature and IHDR
size), a relative file must exist next to the page and be a PNG. In the browser: after the page's load event
each image must have decoded (naturalWidth > 0), be displayed inside the screenshot, and its box in the
screenshot must not be blank (at least MIN_INK of its pixels differ from the box's most common colour).
A broken image exits 1 naming it.

Needs Chromium (Debian: `apt-get install -y chromium`; `bash scripts/test_deps.sh` installs it as root) and
Pillow (a dependency of matplotlib). Runs Chromium headless with a fresh profile folder and no
network-facing background services.

Usage:
    python scripts/screenshot_report.py engines/smollm2/report/index.html --out report.png
    python scripts/screenshot_report.py /tmp/r/index.html --out shot.png --width 1280 --height 7000
"""

from __future__ import annotations

import argparse
import base64
import json
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from html import unescape
from html.parser import HTMLParser
from pathlib import Path

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
MIN_INK = 0.005  # a matplotlib figure has axes, ticks and labels: a few % of its pixels at least
PROBE_ID = "screenshot-report-probe"
# Appended to a copy of the page: on the load event, records for each <img> whether it decoded and where its
# content box (inside the border) lies in page pixels, as JSON in a hidden <pre> that --dump-dom prints.
PROBE = f"""<script>
addEventListener("load", () => {{
  const rows = Array.from(document.images, im => {{
    const r = im.getBoundingClientRect();
    return {{src: (im.getAttribute("src") || "").slice(0, 40), complete: im.complete,
            natural: [im.naturalWidth, im.naturalHeight],
            box: [r.left + scrollX + im.clientLeft, r.top + scrollY + im.clientTop, im.clientWidth, im.clientHeight]}};
  }});
  const pre = document.createElement("pre");
  pre.id = "{PROBE_ID}"; pre.hidden = true; pre.textContent = JSON.stringify(rows);
  document.body.appendChild(pre);
}});
</script>"""


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


def _chromium(browser: str, url: str, mode: list[str], width: int, height: int,
              timeout: int) -> subprocess.CompletedProcess:
    """Run headless Chromium once on `url` (mode: ["--dump-dom"] or ["--screenshot=PATH"]) with a fresh profile."""
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--hide-scrollbars", f"--user-data-dir={profile}", f"--window-size={width},{height}", *mode, url]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _failed(browser: str, proc: subprocess.CompletedProcess, what: str) -> SystemExit:
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return SystemExit(f"screenshot_report: {browser} exited {proc.returncode} without {what}: " + " | ".join(tail))


def screenshot(page: Path, out: Path, width: int, height: int, browser: str, timeout: int) -> list[str]:
    """Screenshot `page` (width x height window) into `out` and check each <img> as Chromium shows it.

    Both runs open a copy of the page in a temporary folder, with a <base> pointing at the page's folder
    (relative images resolve as in the original) and PROBE appended (hidden, so the layout is the page's).
    Returns one line per image: 'ok img #n in Chromium ...' or 'BROKEN img #n in Chromium: <why>'.
    """
    from PIL import Image

    html = page.read_text(encoding="utf-8")
    base = f'<base href="{page.resolve().parent.as_uri()}/">'
    head = re.search(r"<head[^>]*>", html, re.IGNORECASE)
    html = html[:head.end()] + base + html[head.end():] if head else base + html
    body_end = html.lower().rfind("</body>")
    html = html[:body_end] + PROBE + html[body_end:] if body_end >= 0 else html + PROBE
    with tempfile.TemporaryDirectory(prefix="screenshot-report-") as tmp:
        probed = Path(tmp) / page.name
        probed.write_text(html, encoding="utf-8")
        url = probed.as_uri()
        proc = _chromium(browser, url, ["--dump-dom"], width, height, timeout)
        found = re.search(rf'<pre id="{PROBE_ID}"[^>]*>(.*?)</pre>', proc.stdout, re.DOTALL)
        if proc.returncode != 0 or not found:
            raise _failed(browser, proc, "the page's image probe (did the load event fire?)")
        rows = json.loads(unescape(found.group(1)))
        proc = _chromium(browser, url, [f"--screenshot={out}"], width, height, timeout)
        if proc.returncode != 0 or not out.is_file():
            raise _failed(browser, proc, "a screenshot")
    with Image.open(out) as im:
        shot = im.convert("RGB")
    lines = []
    for n, row in enumerate(rows, 1):
        what = f"img #{n} in Chromium"
        x, y, w, h = (round(v) for v in row["box"])
        if not row["complete"] or row["natural"][0] == 0:
            lines.append(f"BROKEN {what}: not decoded (naturalWidth 0, src {row['src']!r})")
        elif w <= 0 or h <= 0:
            lines.append(f"BROKEN {what}: not displayed (box {w}x{h})")
        elif x < 0 or y < 0 or x + w > shot.width or y + h > shot.height:
            lines.append(f"BROKEN {what}: box {w}x{h} at ({x}, {y}) lies outside the {shot.width}x{shot.height} "
                         "screenshot (raise --height)")
        else:
            box = shot.crop((x, y, x + w, y + h))
            ink = 1 - max(box.getcolors(w * h))[0] / (w * h)
            state = "ok" if ink >= MIN_INK else "BROKEN"
            lines.append(f"{state} {what}: {row['natural'][0]}x{row['natural'][1]} shown {w}x{h} at ({x}, {y}), "
                         f"{ink:.1%} non-background pixels"
                         + ("" if state == "ok" else f" (blank: < {MIN_INK:.1%})"))
    return lines


def trim_bottom(path: Path, margin: int = 24) -> None:
    """Cut the blank rows below the page's content (the window is taller than the page)."""
    from PIL import Image, ImageChops

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
    shown = screenshot(args.page, args.out, args.width, args.height, find_browser(args.browser), args.timeout)
    for line in shown:
        print(line)
    broken += [line for line in shown if line.startswith("BROKEN")]
    if not args.no_trim:
        trim_bottom(args.out)
    size = png_size(args.out.read_bytes())
    print(f"wrote {args.out} ({size[0]}x{size[1]}, {args.out.stat().st_size} bytes)")
    return 1 if broken or not lines else 0


if __name__ == "__main__":
    sys.exit(main())

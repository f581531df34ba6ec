#!/usr/bin/env python
"""How much repeated profiles of the same engines agree: per profile/sps.json, the quantities the scheduler
reads (t(1), t(8), drafter block d(1), the ratios d(1)/t(1), t(8)/t(1), d(16)/t(16)) and the layout fit's
largest error; per group, the median [min–max]. Groups are separated by `--`.

    python scripts/profile_spread.py runs/old-*.json -- runs/new-*.json
"""

from __future__ import annotations

import sys

import numpy as np

COLUMNS = ("t(1) ms", "t(8) ms", "d(1) ms", "d(1)/t(1)", "t(8)/t(1)", "d(16)/t(16)", "fit err %")


def _row(path: str) -> list[float]:
    from dspark_export.engines.sps import read_sps

    sps = read_sps(path)
    ms = sps.latencies_ms()
    t, d = ms["target"], ms["drafter_block"]
    big = max(r for r in d if r in t)
    return [t[1], t[8], d[1], d[1] / t[1], t[8] / t[1], d[big] / t[big], sps.get("attention")["max_error_pct"]]


def main(argv: list[str]) -> int:
    groups: list[list[str]] = [[]]
    for arg in argv:
        if arg == "--":
            groups.append([])
        else:
            groups[-1].append(arg)
    groups = [g for g in groups if g]
    print("| group | runs | " + " | ".join(COLUMNS) + " |")
    print("|---|---:|" + "---:|" * len(COLUMNS))
    for i, paths in enumerate(groups):
        a = np.array([_row(p) for p in paths])
        cells = [f"{np.median(c):.3g} [{c.min():.3g}–{c.max():.3g}]" for c in a.T]
        print(f"| {i + 1} | {len(paths)} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""A dependency-free PNG line chart (zlib + struct only), for `autoplan scaling --plot`.

Deliberately small: axes with tick labels, one or more polylines with point markers, a legend, and a 3x5 pixel
font scaled up. It keeps matplotlib out of the planner's dependencies.
"""

from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path

# 3x5 glyphs, one string of 5 rows of 3 bits per character ('#' = ink).
_FONT_ROWS = {
    "0": "### #.# #.# #.# ###", "1": ".#. ##. .#. .#. ###", "2": "### ..# ### #.. ###", "3": "### ..# ### ..# ###",
    "4": "#.# #.# ### ..# ..#", "5": "### #.. ### ..# ###", "6": "### #.. ### #.# ###", "7": "### ..# .#. .#. .#.",
    "8": "### #.# ### #.# ###", "9": "### #.# ### ..# ###", "A": ".#. #.# ### #.# #.#", "B": "##. #.# ##. #.# ##.",
    "C": "### #.. #.. #.. ###", "D": "##. #.# #.# #.# ##.", "E": "### #.. ##. #.. ###", "F": "### #.. ##. #.. #..",
    "G": "### #.. #.# #.# ###", "H": "#.# #.# ### #.# #.#", "I": "### .#. .#. .#. ###", "J": "..# ..# ..# #.# ###",
    "K": "#.# #.# ##. #.# #.#", "L": "#.. #.. #.. #.. ###", "M": "#.# ### ### #.# #.#", "N": "##. #.# #.# #.# #.#",
    "O": "### #.# #.# #.# ###", "P": "### #.# ### #.. #..", "Q": "### #.# #.# ### ..#", "R": "##. #.# ##. #.# #.#",
    "S": "### #.. ### ..# ###", "T": "### .#. .#. .#. .#.", "U": "#.# #.# #.# #.# ###", "V": "#.# #.# #.# #.# .#.",
    "W": "#.# #.# ### ### #.#", "X": "#.# #.# .#. #.# #.#", "Y": "#.# #.# .#. .#. .#.", "Z": "### ..# .#. #.. ###",
    ".": "... ... ... ... .#.", "/": "..# ..# .#. #.. #..", "-": "... ... ### ... ...", " ": "... ... ... ... ...",
    "%": "#.# ..# .#. #.. #.#", "(": ".#. #.. #.. #.. .#.", ")": ".#. ..# ..# ..# .#.", ",": "... ... ... .#. #..",
    ":": "... .#. ... .#. ...", "=": "... ### ... ### ...", "+": "... .#. ### .#. ...",
}


class Canvas:
    def __init__(self, width: int, height: int, bg: tuple[int, int, int] = (255, 255, 255)) -> None:
        self.w, self.h = width, height
        self.px = bytearray(bytes(bg) * (width * height))

    def set(self, x: int, y: int, c: tuple[int, int, int]) -> None:
        if 0 <= x < self.w and 0 <= y < self.h:
            i = 3 * (y * self.w + x)
            self.px[i:i + 3] = bytes(c)

    def rect(self, x0: int, y0: int, x1: int, y1: int, c: tuple[int, int, int]) -> None:
        for y in range(max(0, y0), min(self.h, y1 + 1)):
            for x in range(max(0, x0), min(self.w, x1 + 1)):
                self.set(x, y, c)

    def line(self, x0: float, y0: float, x1: float, y1: float, c: tuple[int, int, int], width: int = 1,
             dash: int = 0) -> None:
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        r = width // 2
        for i in range(n + 1):
            if dash and (i // dash) % 2:
                continue
            t = i / n
            x, y = int(round(x0 + (x1 - x0) * t)), int(round(y0 + (y1 - y0) * t))
            self.rect(x - r, y - r, x + r, y + r, c)

    def text(self, x: int, y: int, s: str, c: tuple[int, int, int] = (0, 0, 0), scale: int = 2,
             anchor: str = "left") -> None:
        s = s.upper()
        wpx = len(s) * 4 * scale
        if anchor == "center":
            x -= wpx // 2
        elif anchor == "right":
            x -= wpx
        for k, ch in enumerate(s):
            rows = _FONT_ROWS.get(ch, _FONT_ROWS[" "]).split()
            for ry, row in enumerate(rows):
                for rx, bit in enumerate(row):
                    if bit == "#":
                        self.rect(x + (4 * k + rx) * scale, y + ry * scale, x + (4 * k + rx) * scale + scale - 1,
                                  y + ry * scale + scale - 1, c)

    def save(self, path: str | Path) -> Path:
        raw = b"".join(b"\x00" + bytes(self.px[3 * y * self.w:3 * (y + 1) * self.w]) for y in range(self.h))

        def chunk(tag: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

        png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0))
        png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
        path = Path(path)
        path.write_bytes(png)
        return path


def _nice(v: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(v) >= div:
            return f"{v / div:.3g}{unit}"
    return f"{v:.3g}"


COLOURS = [(31, 119, 180), (150, 150, 150), (214, 39, 40), (44, 160, 44)]


def line_chart(path: str | Path, xs: list[float], series: list[tuple[str, list[float | None]]], *,
               title: str, xlabel: str, ylabel: str, logx: bool = True, logy: bool = False, width: int = 800,
               height: int = 500) -> Path:
    """Polylines of `series` (name, ys; None = missing point) against xs; x on a log2 axis by default,
    y linear from 0 or (logy) logarithmic around the data."""
    cv = Canvas(width, height)
    left, right, top, bottom = 90, 30, 70, 60
    pw, ph = width - left - right, height - top - bottom
    fx = (lambda v: math.log2(v)) if logx else (lambda v: v)
    xmin, xmax = fx(min(xs)), fx(max(xs))
    if xmax == xmin:
        xmax = xmin + 1
    ally = [y for _, ys in series for y in ys if y is not None and (y > 0 or not logy)]
    if logy and ally:
        lo, hi = math.log(min(ally)), math.log(max(ally))
        pad = max(0.05 * (hi - lo), 0.05)
        ymin, ymax = lo - pad, hi + pad
        fy = math.log
    else:
        ymin, ymax = 0.0, (max(ally) * 1.08 if ally else 1.0)
        fy = float
    if ymax <= ymin:
        ymax = ymin + 1.0

    def px(v: float) -> float:
        return left + (fx(v) - xmin) / (xmax - xmin) * pw

    def py(v: float) -> float:
        return top + ph - (fy(v) - ymin) / (ymax - ymin) * ph

    grey, black = (225, 225, 225), (0, 0, 0)
    for i in range(6):  # horizontal grid and y ticks
        t = ymin + (ymax - ymin) * i / 5
        v = math.exp(t) if logy else t
        y = int(py(v))
        cv.line(left, y, left + pw, y, grey)
        cv.text(left - 8, y - 5, _nice(v), scale=2, anchor="right")
    for v in xs:  # x ticks at the data points
        x = int(px(v))
        cv.line(x, top, x, top + ph, grey)
        cv.text(x, top + ph + 10, _nice(v), scale=2, anchor="center")
    cv.line(left, top, left, top + ph, black, 2)
    cv.line(left, top + ph, left + pw, top + ph, black, 2)
    cv.text(width // 2, 12, title, scale=3, anchor="center")
    cv.text(width // 2, height - 25, xlabel, scale=2, anchor="center")
    cv.text(8, top - 24, ylabel, scale=2)
    for k, (name, ys) in enumerate(series):
        c = COLOURS[k % len(COLOURS)]
        pts = [(px(x), py(y)) for x, y in zip(xs, ys, strict=True) if y is not None and (y > 0 or not logy)]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
            cv.line(x0, y0, x1, y1, c, 3, dash=8 if k == 1 else 0)
        for x, y in pts:
            cv.rect(int(x) - 4, int(y) - 4, int(x) + 4, int(y) + 4, c)
        ly = top + 10 + 22 * k
        cv.rect(left + 15, ly, left + 35, ly + 8, c)
        cv.text(left + 45, ly - 1, name, scale=2)
    return cv.save(path)

"""systemd unit files as the unit runner reads them: sections and keys, durations, EnvironmentFile=, and
ExecStart= words with systemd's variable expansion."""

from __future__ import annotations

import os
import pwd
import re
import shlex
from dataclasses import dataclass
from pathlib import Path


class UnitError(Exception):
    pass


def parse_duration(text: str) -> float:
    """systemd time span ("5s", "2min", "330s", "20min", "1h 5s", "500ms", plain seconds)."""
    units = {"us": 1e-6, "ms": 1e-3, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600}
    text = text.strip()
    if text == "infinity":
        return float("inf")
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    total, pos = 0.0, 0
    for m in re.finditer(r"\s*(\d+(?:\.\d+)?)\s*([a-z]+)", text):
        if m.start() != pos or m.group(2) not in units:
            raise UnitError(f"cannot parse time span {text!r}")
        total += float(m.group(1)) * units[m.group(2)]
        pos = m.end()
    if pos != len(text):
        raise UnitError(f"cannot parse time span {text!r}")
    return total


@dataclass
class Unit:
    name: str                      # e.g. openjev-replica@0.service
    path: Path
    sections: dict[str, list[tuple[str, str]]]

    @classmethod
    def load(cls, unit_dir: Path, name: str) -> "Unit":
        """Load NAME from UNIT_DIR; an instance name falls back to its template file."""
        path = unit_dir / name
        if not path.exists():
            m = re.fullmatch(r"(.+@)([^.]+)(\.\w+)", name)
            if not m or not (unit_dir / f"{m.group(1)}{m.group(3)}").exists():
                raise UnitError(f"no unit file for {name} in {unit_dir}")
            path = unit_dir / f"{m.group(1)}{m.group(3)}"
        sections: dict[str, list[tuple[str, str]]] = {}
        current = None
        for raw in path.read_text().splitlines():
            line = raw.strip()
            if not line or line[0] in "#;":
                continue
            if line.startswith("[") and line.endswith("]"):
                current = sections.setdefault(line[1:-1], [])
                continue
            if current is None or "=" not in line:
                raise UnitError(f"{path}: cannot parse line {raw!r}")
            key, value = line.split("=", 1)
            current.append((key.strip(), value.strip()))
        return cls(name, path, sections)

    def all(self, section: str, key: str) -> list[str]:
        values: list[str] = []
        for k, v in self.sections.get(section, []):
            if k == key:
                if v == "":
                    values.clear()  # an empty assignment resets the list, as in systemd
                else:
                    values.append(v)
        return values

    def get(self, section: str, key: str, default: str | None = None) -> str | None:
        values = self.all(section, key)
        return values[-1] if values else default

    @property
    def instance(self) -> str:
        m = re.fullmatch(r".+@([^.]*)\.\w+", self.name)
        return m.group(1) if m else ""

    def specifiers(self, text: str, runtime_dir: Path) -> str:
        user = pwd.getpwuid(os.getuid())
        table = {"i": self.instance, "I": self.instance, "n": self.name, "N": self.name.rsplit(".", 1)[0],
                 "t": str(runtime_dir), "h": user.pw_dir, "u": user.pw_name, "%": "%"}

        def sub(m: re.Match) -> str:
            if m.group(1) not in table:
                raise UnitError(f"{self.name}: specifier %{m.group(1)} is not modelled")
            return table[m.group(1)]

        return re.sub(r"%(.)", sub, text)


def read_environment_file(path: Path) -> dict[str, str]:
    env = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        key, _, value = line.partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key.strip()] = value
    return env


def expand_command(line: str, env: dict[str, str]) -> list[str]:
    """ExecStart= word splitting and variable expansion as systemd.service(5) describes it."""
    words = shlex.split(line)
    if words and words[0][:1] in "-@+!:|":
        raise UnitError(f"ExecStart prefix {words[0][0]!r} is not modelled")
    out: list[str] = []
    for w in words:
        m = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", w)
        if m:  # "$VAR" as a word of its own: split at whitespace, nothing if empty
            out.extend(env.get(m.group(1), "").split())
        else:
            out.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda mm: env.get(mm.group(1), ""), w))
    return out

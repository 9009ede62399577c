"""Tuner profiles (scheduler x running-request cap, flags, environment) and input sets, parsed and checked."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from openjev.common import UserError, read_json

DEFAULT_PROFILES = "fcfs:8,fcfs:16,fcfs:32,lpm:16"


SCHEDULE_POLICIES = ("lpm", "fcfs", "random", "dfs-weight", "lof", "priority", "routing-key")


RESERVED_ENV = ("CUDA_VISIBLE_DEVICES", "MAX_RUNNING_REQUESTS", "SCHEDULE_POLICY")


NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


ENV_KEY_RE = re.compile(r"^[A-Z_][A-Z0-9_]*$")


@dataclass
class Profile:
    name: str
    schedule_policy: str
    max_running_requests: int
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"name": self.name, "schedule_policy": self.schedule_policy,
                "max_running_requests": self.max_running_requests, "extra_args": list(self.extra_args),
                "env": dict(self.env)}


def _slug(text: str) -> str:
    return re.sub(r"-{2,}", "-", re.sub(r"[^a-z0-9.]+", "-", text.lower())).strip("-.")


def default_profile_name(policy: str, n: int, extra_args: Sequence[str], env: dict[str, str]) -> str:
    parts = [policy, str(n)]
    for a in extra_args:
        parts.append("no-radix" if a == "--disable-radix-cache" else _slug(a))
    parts += [_slug(f"{k}-{v}") for k, v in env.items()]
    return "-".join(p for p in parts if p)[:64].rstrip("-.")


def make_profile(name: str | None, policy: Any, n: Any, extra_args: Any = (), env: Any = None, where: str = "") -> Profile:
    where = where or "profile"
    if not isinstance(policy, str) or policy not in SCHEDULE_POLICIES:
        raise UserError(f"{where}: schedule policy must be one of {', '.join(SCHEDULE_POLICIES)}, got {policy!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise UserError(f"{where}: max running requests must be a positive integer, got {n!r}")
    if not isinstance(extra_args, (list, tuple)) or not all(isinstance(a, str) and a for a in extra_args):
        raise UserError(f"{where}: extra_args must be a list of non-empty strings")
    env = {} if env is None else env
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise UserError(f"{where}: env must be an object of string values")
    for k in env:
        if not ENV_KEY_RE.match(k):
            raise UserError(f"{where}: environment variable name {k!r} is not valid")
        if k in RESERVED_ENV:
            raise UserError(f"{where}: {k} is set by the tuner (--gpu, the profile's policy and cap); remove it")
    name = name if name is not None else default_profile_name(policy, n, extra_args, env)
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise UserError(f"{where}: profile name {name!r} must match {NAME_RE.pattern} (it names a directory)")
    return Profile(name, policy, n, list(extra_args), dict(env))


def parse_profile_item(item: str) -> Profile:
    """One `[NAME=]POLICY:N[+MOD...]` item of --profiles (syntax in the module docstring)."""
    text = item.strip()
    name = None
    m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)=(.*)$", text)
    if m:
        name, text = m.group(1), m.group(2)
    head, *mods = text.split("+")
    m = re.match(r"^([a-z][a-z-]*):(\d+)$", head.strip())
    if not m:
        raise UserError(f"profile {item!r}: expected [NAME=]POLICY:N[+MOD...], e.g. fcfs:8 or lpm:16+no-radix")
    extra_args: list[str] = []
    env: dict[str, str] = {}
    for mod in (x.strip() for x in mods):
        if mod == "no-radix":
            extra_args.append("--disable-radix-cache")
        elif mod.startswith("--") and len(mod) > 2:
            extra_args.append(mod)
        elif "=" in mod and ENV_KEY_RE.match(mod.split("=", 1)[0]):
            k, v = mod.split("=", 1)
            env[k] = v
        else:
            raise UserError(f"profile {item!r}: modifier {mod!r} is not no-radix, --FLAG[=VALUE] or KEY=VALUE")
    return make_profile(name, m.group(1), int(m.group(2)), extra_args, env, where=f"profile {item!r}")


def parse_profiles(spec: str) -> list[Profile]:
    """--profiles: the compact list syntax, or the path of a JSON file (a list of profile objects)."""
    spec = spec.strip()
    if not spec:
        raise UserError("--profiles is empty")
    path = Path(spec).expanduser()
    if spec.endswith(".json") or path.is_file():
        data = read_json(path, "profiles file")
        if not isinstance(data, list) or not data:
            raise UserError(f"profiles file {path} must hold a non-empty JSON list of profile objects")
        profiles = []
        allowed = {"name", "schedule_policy", "max_running_requests", "extra_args", "env"}
        for i, obj in enumerate(data):
            where = f"profiles file {path} entry {i}"
            if not isinstance(obj, dict):
                raise UserError(f"{where} is not an object")
            if unknown := sorted(set(obj) - allowed):
                raise UserError(f"{where}: unknown key(s) {', '.join(unknown)} (allowed: {', '.join(sorted(allowed))})")
            profiles.append(make_profile(obj.get("name"), obj.get("schedule_policy"), obj.get("max_running_requests"),
                                         obj.get("extra_args", []), obj.get("env"), where))
    else:
        profiles = [parse_profile_item(x) for x in spec.split(",") if x.strip()]
    seen: set[str] = set()
    for p in profiles:
        if p.name in seen:
            raise UserError(f"profile name {p.name!r} appears twice; give one a name (NAME=POLICY:N...)")
        seen.add(p.name)
    return profiles


@dataclass(frozen=True)
class InputSet:
    name: str
    inputs: Path
    tokens: Path
    reference: Path

    def to_json(self) -> dict:
        return {"name": self.name, "inputs": str(self.inputs), "tokens": str(self.tokens), "reference": str(self.reference)}


def parse_set(text: str) -> InputSet:
    """--set NAME=INPUTS.jsonl,TOKENS.jsonl,REFDIR (paths made absolute; existence checked later)."""
    m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]{0,31})=([^,]+),([^,]+),([^,]+)$", text.strip())
    if not m:
        raise UserError(f"--set {text!r}: expected NAME=INPUTS.jsonl,TOKENS.jsonl,REFDIR (NAME of [A-Za-z0-9._-])")
    name, *paths = m.groups()
    inputs, tokens, ref = (Path(p.strip()).expanduser().absolute() for p in paths)
    return InputSet(name, inputs, tokens, ref)


def check_set_files(s: InputSet, truncate: int) -> dict:
    """The bench's own pre-request checks (hashes, ids, shapes, truncation), before any server starts."""
    from openjev.bench.inputs import load_run_data

    ns = argparse.Namespace(inputs=s.inputs, tokens=s.tokens, reference=s.reference, truncate=truncate)
    try:
        data = load_run_data(ns)
    except UserError as exc:
        raise UserError(f"--set {s.name}: {exc}") from None
    return {"rows": len(data.row_ids), "inputs_sha256": data.inputs_sha, "tokens_sha256": data.tokens_sha,
            "ids_sha256": data.ids_sha, "reference_logits_sha256": data.ref_npy_sha}

"""Types for tests/service/test_extract_cli.py's ``stencil extract --type extract_types:...``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Person:
    name: str
    age: int


@dataclass
class Team:
    name: str
    members: list[Person]
